"""Finding the refused message(s) of a request a broker refused as a whole (sinks/isolation.py),
without a broker: `send` plays a broker that refuses any request holding a bad id."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from outbox_migrate.errors import SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.sinks.isolation import isolate

CREATED = "2026-11-26T12:00:00+00:00"


def messages(count: int) -> list[Message]:
    return [Message(i, "public.outbox", "e", None, "{}", CREATED) for i in range(1, count + 1)]


class Broker:
    """Refuses a whole request when it holds a bad id; records what it accepted."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad
        self.accepted: list[MessageId] = []
        self.requests = 0

    def send(self, group: Sequence[Message]) -> dict[MessageId, str]:
        self.requests += 1
        if any(m.id in self.bad for m in group):
            return {m.id: "INVALID_RECORD" for m in group}
        self.accepted.extend(m.id for m in group)
        return {}


@pytest.mark.parametrize("bad", [{1}, {42}, {100}, {7, 8}, {3, 50, 99}])
def test_the_refused_ones_are_found_and_every_other_one_is_accepted_once_in_order(
    bad: set[int],
) -> None:
    broker = Broker(bad)
    rejected = isolate(messages(100), broker.send, time.monotonic() + 60, "kafka")
    assert rejected == dict.fromkeys(sorted(bad), "INVALID_RECORD")
    assert broker.accepted == [i for i in range(1, 101) if i not in bad]
    assert broker.requests <= len(bad) * 2 * 7 + 1  # ~2·log2(100) per bad message


def test_every_message_bad_ends_with_every_one_refused_alone() -> None:
    broker = Broker(set(range(1, 9)))
    assert isolate(messages(8), broker.send, time.monotonic() + 60, "kafka") == dict.fromkeys(
        range(1, 9), "INVALID_RECORD"
    )


def test_a_partial_refusal_is_trusted_for_the_ones_refused_alone() -> None:
    """A request split by the broker (two record batches): only one refused — that is it."""
    calls: list[list[MessageId]] = []

    def send(group: Sequence[Message]) -> dict[MessageId, str]:
        calls.append([m.id for m in group])
        return {3: "MSG_SIZE_TOO_LARGE"} if any(m.id == 3 for m in group) else {}

    assert isolate(messages(4), send, time.monotonic() + 60, "kafka") == {3: "MSG_SIZE_TOO_LARGE"}
    assert calls == [[1, 2], [3, 4]]  # the whole was refused already: its halves are sent


def test_the_deadline_makes_it_an_outage_not_a_guess() -> None:
    broker = Broker({5})
    with pytest.raises(SinkUnavailable, match="not found within the sink timeout"):
        isolate(messages(10), broker.send, time.monotonic() - 1, "redis")
    assert broker.requests == 0


class Clock:
    """The search's clock: every request takes a second."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_a_search_cut_by_the_deadline_names_what_the_halves_delivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay marks those and claims only the rest again: the next publish searches fewer
    messages. Naming none (as before), a search that never fits in the sink timeout began
    again from the whole batch on every retry, and the outbox stopped behind one record."""
    import types

    clock, broker = Clock(), Broker({42})
    monkeypatch.setattr(
        "outbox_migrate.relay.sinks.isolation.time",
        types.SimpleNamespace(monotonic=clock.monotonic),
    )

    def send(group: Sequence[Message]) -> dict[MessageId, str]:
        clock.now += 1.0
        return broker.send(group)

    with pytest.raises(SinkUnavailable, match="not found within the sink timeout") as caught:
        isolate(messages(100), send, 3.0, "kafka")
    # 1-50 refused, then 1-25 accepted, 26-50 refused: the deadline.
    assert caught.value.acknowledged == broker.accepted == list(range(1, 26))


def test_an_outage_during_the_search_keeps_what_the_halves_delivered() -> None:
    broker = Broker({42})

    def send(group: Sequence[Message]) -> dict[MessageId, str]:
        if broker.requests == 2:  # 1-50 refused, 1-25 accepted, then the broker is away
            raise SinkUnavailable("kafka", "broker down")
        return broker.send(group)

    with pytest.raises(SinkUnavailable, match="broker down") as caught:
        isolate(messages(100), send, time.monotonic() + 60, "kafka")
    assert caught.value.acknowledged == list(range(1, 26))
