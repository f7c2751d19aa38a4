"""Message: the fields a claim builds it from and the headers every sink sends."""

from __future__ import annotations

from datetime import UTC, datetime

from outbox_migrate.relay.message import Message

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).isoformat()


def test_a_six_column_claim_row_builds_a_message_without_extra_headers() -> None:
    message = Message(*(7, "public.outbox", "OrderCreated", "k", "{}", NOW))
    assert message.extra_headers == ()
    assert message.headers() == {
        "outbox-id": "7", "outbox-table": "public.outbox", "event-type": "OrderCreated"
    }  # fmt: skip


def test_extra_headers_follow_the_built_in_ones_in_order_and_pass_unchanged() -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    extra = (("traceparent", traceparent), ("tenant-id", "acme"), ("a", ""))
    message = Message(7, "public.outbox", None, None, "{}", NOW, extra)
    headers = message.headers()
    assert list(headers) == ["outbox-id", "outbox-table", "traceparent", "tenant-id", "a"]
    assert headers["traceparent"] == traceparent


def test_an_extra_header_cannot_override_the_outbox_id() -> None:
    message = Message(7, "public.outbox", None, None, "{}", NOW, (("outbox-id", "1"),))
    assert message.headers()["outbox-id"] == "7"


def test_split_suspects_sends_each_suspect_alone_in_claim_order() -> None:
    """A message with a failure on record is published alone (relay/bad_rows.py), and the
    order of the batch is kept: the messages between suspects go together."""
    from outbox_migrate.relay.publishing import split_suspects

    batch = [Message(i, "public.outbox", None, None, "{}", "2026-01-01T00:00:00+00:00")
             for i in range(1, 8)]  # fmt: skip
    parts = [[m.id for m in part] for part in split_suspects(batch, {2, 3, 7}.__contains__)]
    assert parts == [[1], [2], [3], [4, 5, 6], [7]]
