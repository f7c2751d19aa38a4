"""Claimed rows → messages, and one message a sink cannot represent: no database needed.

The claim leaves to `relay/claimed.py` what only fails row by row (a bytea body that is not
UTF-8, a text headers value that is not a JSON object); `relay/publishing.py` sets aside a
message the sink cannot represent and publishes the rest.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence

import pytest

from outbox_migrate.errors import MessagesRejected, UnrepresentableMessage
from outbox_migrate.relay import claimed, publishing, queries
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks.stdout import StdoutSink

NOW = "2026-01-02T03:04:05.000000+00:00"
PICKLE = b"\x80\x04\x95\x10\x00"


def row(i: int, payload: object, *more: object) -> tuple[object, ...]:
    return (i, "public.outbox", "e", "k", payload, NOW, f"(0,{i})", *more)


def test_a_bytea_body_is_text_when_utf8_and_raw_bytes_otherwise() -> None:
    columns = queries.Columns(event_type="e", key="k", payload_type="bytea")
    got = claimed.messages([row(1, b'{"n": 1}'), row(2, PICKLE)], Message, columns)
    assert got.bad == []
    assert got.messages[0].payload == '{"n": 1}'
    assert got.messages[1].payload == PICKLE and got.messages[1].payload_bytes == PICKLE


def test_text_headers_are_parsed_and_metadata_wins_over_a_same_named_entry() -> None:
    columns = queries.Columns(
        event_type="e", key="k", headers="h", headers_type="text", metadata=("tenant",)
    )
    text = json.dumps({"traceparent": "tp", "tenant": "from-headers", "n": 3, "gone": None})
    got = claimed.messages([row(1, "{}", [["tenant", "t-1"]], text)], Message, columns)
    assert got.messages[0].extra_headers == (("traceparent", "tp"), ("n", "3"), ("tenant", "t-1"))


@pytest.mark.parametrize("value", ["not json {", "[1, 2]", '"a string"', "42"])
def test_text_headers_that_are_not_an_object_make_a_bad_row(value: str) -> None:
    columns = queries.Columns(event_type="e", key="k", headers="h", headers_type="varchar")
    got = claimed.messages([row(1, "{}", [], value), row(2, "{}", [], "{}")], Message, columns)
    assert [m.id for m in got.messages] == [2]
    assert [(b.message.id, b.reason) for b in got.bad] == [(1, claimed.HEADERS_NOT_OBJECT)]


@pytest.mark.parametrize("value", [None, "null"])
def test_no_text_headers_is_no_headers_not_a_bad_row(value: str | None) -> None:
    columns = queries.Columns(event_type="e", key="k", headers="h", headers_type="text")
    got = claimed.messages([row(1, "{}", [], value)], Message, columns)
    assert got.bad == [] and got.messages[0].extra_headers == ()


def test_json_headers_the_claim_found_not_to_be_an_object_make_a_bad_row() -> None:
    columns = queries.Columns(event_type="e", key="k", headers="h")
    got = claimed.messages([row(1, "{}", None), row(2, "{}", [["a", "b"]])], Message, columns)
    assert [b.message.id for b in got.bad] == [1]
    assert got.messages[0].extra_headers == (("a", "b"),)


def test_a_raw_payload_has_no_envelope() -> None:
    message = Message(9, "public.outbox", None, None, PICKLE, NOW)
    with pytest.raises(UnrepresentableMessage) as raised:
        message.envelope()
    assert raised.value.message_id == 9 and "not UTF-8" in raised.value.reason


class EnvelopeLines:
    """A sink that renders the whole batch with `Message.envelope()` before writing any of it,
    as the contract lets a sink do: an unrepresentable message stops the rendering."""

    name = "envelope-lines"

    def __init__(self) -> None:
        self.stream = io.StringIO()

    def publish(self, batch: Sequence[Message]) -> None:
        self.stream.write("".join(m.envelope() + "\n" for m in batch))

    def close(self) -> None:
        return None


def test_publish_sets_aside_the_unrepresentable_message_and_sends_the_rest() -> None:
    sink = EnvelopeLines()
    batch = [Message(i, "public.outbox", None, None, PICKLE if i == 2 else "{}", NOW)
             for i in range(1, 5)]  # fmt: skip
    rejected, unrepresentable = publishing.publish(sink, batch)
    assert rejected == {} and list(unrepresentable) == [2]
    assert [json.loads(line)["id"] for line in sink.stream.getvalue().splitlines()] == [1, 3, 4]


def test_the_stdout_sink_rejects_a_raw_payload_by_id() -> None:
    stream = io.StringIO()
    batch = [Message(i, "t", None, None, PICKLE if i == 2 else "{}", NOW) for i in range(1, 4)]
    rejected, unrepresentable = publishing.publish(StdoutSink(stream=stream), batch)
    assert list(rejected) == [2] and unrepresentable == {}
    assert [json.loads(line)["id"] for line in stream.getvalue().splitlines()] == [1, 3]


def test_publish_reports_what_the_broker_rejected_after_setting_aside() -> None:
    class Refuses:
        name = "refuses"

        def publish(self, batch: Sequence[Message]) -> None:
            for message in batch:
                message.envelope()
            raise MessagesRejected(self.name, {3: "too big"})

        def close(self) -> None:
            return None

    batch = [Message(i, "t", None, None, PICKLE if i == 1 else "{}", NOW) for i in range(1, 4)]
    rejected, unrepresentable = publishing.publish(Refuses(), batch)
    assert rejected == {3: "too big"} and list(unrepresentable) == [1]
