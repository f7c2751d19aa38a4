"""Parking: which messages wait behind a refused message of their key (pure bookkeeping)."""

from __future__ import annotations

from datetime import UTC, datetime

from outbox_migrate.relay.message import Message
from outbox_migrate.relay.parking import PARK_STALE_S, Parking

NOW = datetime(2026, 1, 1, tzinfo=UTC).isoformat()
SRC = "public.outbox"


def msg(i: int, key: str | None) -> Message:
    return Message(i, SRC, "e", key, "{}", NOW)


def one_second(_attempt: int) -> float:
    return 1.0


def test_a_retry_holds_later_messages_of_its_key_only() -> None:
    parking = Parking()
    batch = [msg(1, "a"), msg(2, "b"), msg(3, "a"), msg(4, None), msg(5, "b")]
    held = parking.settle(SRC, batch, {2: 1}, {1, 3, 4}, now=0.0, backoff=one_second)
    assert held == {5}
    assert parking.parked(SRC, "b") is not None and parking.parked(SRC, "b").id == 2


def test_parked_key_is_withheld_until_due_then_released_when_resolved() -> None:
    parking = Parking()
    parking.settle(SRC, [msg(2, "b")], {2: 1}, set(), now=0.0, backoff=one_second)
    batch = [msg(1, "b"), msg(2, "b"), msg(3, "a"), msg(6, "b")]
    send, withheld = parking.withhold(SRC, batch, now=0.5)
    assert [m.id for m in send] == [1, 3] and [m.id for m in withheld] == [2, 6]
    send, withheld = parking.withhold(SRC, batch, now=1.5)
    assert [m.id for m in send] == [1, 2, 3] and [m.id for m in withheld] == [6]
    assert parking.settle(SRC, send, {}, {1, 2, 3}, now=1.5, backoff=one_second) == set()
    assert not parking
    assert parking.withhold(SRC, batch, now=1.6) == (batch, [])


def test_a_park_whose_message_never_came_back_goes_stale() -> None:
    parking = Parking()
    parking.settle(SRC, [msg(2, "b")], {2: 3}, set(), now=0.0, backoff=one_second)
    send, _ = parking.withhold(SRC, [msg(7, "b")], now=1.0 + PARK_STALE_S + 0.1)
    assert [m.id for m in send] == [7] and not parking


def test_keyless_messages_park_together_and_sources_are_separate() -> None:
    parking = Parking()
    parking.settle(SRC, [msg(2, None)], {2: 1}, set(), now=0.0, backoff=one_second)
    send, withheld = parking.withhold(SRC, [msg(3, None)], now=0.1)
    assert send == [] and [m.id for m in withheld] == [3]
    other = Message(3, "public.other", "e", None, "{}", NOW)
    assert parking.withhold("public.other", [other], now=0.1) == ([other], [])
