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
    held = parking.settle(SRC, batch, {2: 1}, now=0.0, backoff=one_second, last=5).held
    assert held == {5}
    assert parking.parked(SRC, "b") is not None and parking.parked(SRC, "b").id == 2


def test_parked_key_is_withheld_until_due_then_released_when_resolved() -> None:
    parking = Parking()
    parking.settle(SRC, [msg(2, "b")], {2: 1}, now=0.0, backoff=one_second, last=2)
    batch = [msg(1, "b"), msg(2, "b"), msg(3, "a"), msg(6, "b")]
    send, withheld = parking.withhold(SRC, batch, now=0.5)
    assert [m.id for m in send] == [1, 3] and [m.id for m in withheld] == [2, 6]
    # Due, and the claim reached back to it: the parked message goes out alone of its key.
    send, withheld = parking.withhold(SRC, batch, now=1.5)
    assert [m.id for m in send] == [1, 2, 3] and [m.id for m in withheld] == [6]
    # Acknowledged: b drains from just after 2 (6 waits behind it), claimed again from 3.
    assert parking.settle(SRC, send, {}, now=1.5, backoff=one_second, last=6)[:2] == (set(), 3)
    send, withheld = parking.withhold(SRC, [msg(6, "b"), msg(7, "a")], now=1.6, after=2)
    assert [m.id for m in send] == [6, 7] and withheld == []
    assert parking.settle(SRC, send, {}, now=1.6, backoff=one_second, last=7)[:2] == (set(), None)
    assert not parking
    assert parking.withhold(SRC, batch, now=1.7) == (batch, [])


def test_a_park_whose_message_never_came_back_goes_stale() -> None:
    parking = Parking()
    parking.settle(SRC, [msg(2, "b")], {2: 3}, now=0.0, backoff=one_second)
    send, _ = parking.withhold(SRC, [msg(7, "b")], now=1.0 + PARK_STALE_S + 0.1)
    assert [m.id for m in send] == [7] and not parking


def test_keyless_messages_park_together_and_sources_are_separate() -> None:
    parking = Parking()
    parking.settle(SRC, [msg(2, None)], {2: 1}, now=0.0, backoff=one_second)
    send, withheld = parking.withhold(SRC, [msg(3, None)], now=0.1)
    assert send == [] and [m.id for m in withheld] == [3]
    other = Message(3, "public.other", "e", None, "{}", NOW)
    assert parking.withhold("public.other", [other], now=0.1) == ([other], [])


def test_a_released_key_waits_for_its_held_back_messages_below_the_cursor() -> None:
    """Message 2 of key b refused; b's 4 held in its batch, 7 withheld from a claim above the
    cursor. Once 2 is due, a claim from above the cursor (after 8) must not send b's 9 ahead of
    2, 4 and 7. A claim from id 0 sends 2 alone of b; acknowledged, b drains from 3 (the cursor
    claims again from there): a claim that reaches up to 5 sends 4, then b drains from 6 until
    a claim reached 9, the highest id it left behind."""
    parking = Parking()
    settled = parking.settle(
        SRC, [msg(2, "b"), msg(3, "a"), msg(4, "b")], {2: 1}, now=0.0, backoff=one_second, last=4
    )
    assert settled == ({4}, None, {2: 1.0})  # 2 is due again 1 s later (`Cursor.retry_at`)
    assert parking.withhold(SRC, [msg(7, "b"), msg(8, "a")], now=0.5, after=4)[1] == [msg(7, "b")]
    send, withheld = parking.withhold(SRC, [msg(9, "b"), msg(10, "a")], now=1.5, after=8)
    assert [m.id for m in send] == [10] and [m.id for m in withheld] == [9]
    send, withheld = parking.withhold(SRC, [msg(2, "b"), msg(4, "b"), msg(5, "a")], now=1.6)
    assert [m.id for m in send] == [2, 5] and [m.id for m in withheld] == [4]
    assert parking.settle(SRC, send, {}, now=1.6, backoff=one_second, last=5)[:2] == (set(), 3)
    send, _ = parking.withhold(SRC, [msg(4, "b"), msg(5, "a")], now=1.7, after=2)
    assert [m.id for m in send] == [4, 5]
    assert parking.settle(SRC, send, {}, now=1.7, backoff=one_second, last=5)[:2] == (set(), 6)
    park = parking.parked(SRC, "b")
    assert park is not None and park.draining and park.id == 5 and park.high == 9
    send, withheld = parking.withhold(SRC, [msg(11, "b")], now=1.8, after=10)
    assert send == [] and [m.id for m in withheld] == [11]
    send, _ = parking.withhold(SRC, [msg(7, "b"), msg(9, "b"), msg(11, "b")], now=1.9, after=5)
    assert [m.id for m in send] == [7, 9, 11]
    assert parking.settle(SRC, send, {}, now=1.9, backoff=one_second, last=11)[:2] == (set(), None)
    assert not parking


def test_a_parked_message_refused_again_delivered_nothing_of_its_key_ahead_of_it() -> None:
    parking = Parking()
    parking.settle(SRC, [msg(2, "b")], {2: 1}, now=0.0, backoff=one_second, last=2)
    parking.withhold(SRC, [msg(6, "b")], now=0.5, after=2)
    send, withheld = parking.withhold(SRC, [msg(2, "b"), msg(3, "b")], now=1.5)
    assert [m.id for m in send] == [2] and [m.id for m in withheld] == [3]
    assert parking.settle(SRC, send, {2: 2}, now=1.5, backoff=one_second, last=3)[:2] == (
        set(),
        None,
    )
    park = parking.parked(SRC, "b")
    assert park is not None and not park.draining and park.id == 2 and park.high == 6


def test_a_parked_message_dealt_with_elsewhere_lets_its_key_drain() -> None:
    parking = Parking()
    parking.settle(SRC, [msg(2, "b")], {2: 1}, now=0.0, backoff=one_second, last=2)
    parking.withhold(SRC, [msg(6, "b")], now=0.5, after=2)
    send, _ = parking.withhold(SRC, [msg(6, "b"), msg(8, "b")], now=1.5)  # 2 is not there
    assert [m.id for m in send] == [6, 8]
    assert parking.settle(SRC, send, {}, now=1.5, backoff=one_second, last=8)[:2] == (set(), None)
    assert not parking


def test_application_ids_claimed_from_the_start_drain_a_key_without_a_cursor() -> None:
    parking = Parking()
    ids = ["0190-a", "0190-b", "0190-c"]
    first = [Message(i, SRC, "e", "k", "{}", NOW) for i in ids]
    parking.settle(SRC, first[:1], {ids[0]: 1}, now=0.0, backoff=one_second, last=ids[0])
    send, withheld = parking.withhold(SRC, first, now=0.5)
    assert send == [] and withheld == first
    send, _ = parking.withhold(SRC, first, now=1.5)
    assert send == first[:1]
    assert parking.settle(SRC, send, {}, now=1.5, backoff=one_second, last=ids[-1])[:2] == (
        set(),
        None,
    )
    send, _ = parking.withhold(SRC, first[1:], now=1.6)
    assert send == first[1:]
    assert parking.settle(SRC, send, {}, now=1.6, backoff=one_second, last=ids[-1])[:2] == (
        set(),
        None,
    )
    assert not parking
