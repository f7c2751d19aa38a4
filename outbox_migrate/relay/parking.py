"""`--ordering key` after a refusal: a refused message parks its key, the others flow
(docs/relay.md, "Key ordering through a refusal"). Pure bookkeeping, shared by the workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from outbox_migrate.relay.message import Message, MessageId

PARKED_BATCH_WAIT_S = 0.05
"""A claim of withheld messages only waits this long: with `until_empty` the worker would
otherwise rescan from id 0 in a tight loop until the parked message is due."""
PARK_STALE_S = 30.0
"""A parked message not claimed again this long after due was taken by another process."""


@dataclass(frozen=True)
class Park:
    """A key waits for the message `id` due at `due`, or (`draining`) for its messages after
    `id` to be claimed again from below. `high`: the key's highest id left unpublished behind
    the park; only a claim reaching it releases the key."""

    id: MessageId
    due: float
    high: MessageId
    draining: bool = False


class Settled(NamedTuple):
    """What a published batch leaves: `held`, sent ids not to mark; `claim_again_from`, where
    the cursor must claim from again (or None); `due`, parked ids and when each is due."""

    held: set[MessageId]
    claim_again_from: MessageId | None
    due: dict[MessageId, float]


def _before(a: MessageId, b: MessageId) -> bool:
    """Claim order (key ordering claims application ids by id)."""
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    return str(a) < str(b)


def _later(a: MessageId, b: MessageId) -> MessageId:
    return b if _before(a, b) else a


def _behind(park: Park, message_id: MessageId) -> bool:
    return _before(park.id, message_id) if park.draining else not _before(message_id, park.id)


def _covers(after: MessageId, park: Park) -> bool:
    if after == 0 or not (isinstance(after, int) and isinstance(park.id, int)):
        return True
    return after <= park.id if park.draining else after < park.id


class Parking:
    def __init__(self) -> None:
        self._parked: dict[tuple[str, str | None], Park] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._parked)

    def parked(self, source: str, key: str | None) -> Park | None:
        with self._lock:
            return self._parked.get((source, key))

    def withhold(
        self, source: str, batch: Sequence[Message], *, now: float, after: MessageId = 0
    ) -> tuple[list[Message], list[Message]]:
        """Split a batch claimed above `after` into (to send, withheld). A parked key goes
        out only when due *and* reached by the claim, and its parked message alone: refused
        again, nothing of its key overtook it; acknowledged, the key drains after it."""
        if not self._parked:
            return list(batch), []
        with self._lock:
            send: list[Message] = []
            withheld: list[Message] = []
            bound: dict[str | None, Park | None] = {}  # per key: the park to stay behind
            for message in batch:
                key = (source, message.key)
                if message.key not in bound:
                    bound[message.key] = self._bound(key, batch, now=now, after=after)
                limit = bound[message.key]
                if limit is None or not _behind(limit, message.id):
                    send.append(message)
                else:
                    withheld.append(message)
                    park = self._parked[key]
                    self._parked[key] = replace(park, high=_later(park.high, message.id))
            return send, withheld

    def _bound(
        self, key: tuple[str, str | None], batch: Sequence[Message], *, now: float, after: MessageId
    ) -> Park | None:
        park = self._parked.get(key)
        if park is None:
            return None
        if now > park.due + PARK_STALE_S:
            del self._parked[key]
            return None
        if now < park.due or not _covers(after, park):
            return park
        if park.draining:
            return None
        if any(m.id == park.id for m in batch):
            return replace(park, draining=True)  # the parked message alone: `_behind` excludes it
        # Due, reached, and not there: dealt with elsewhere (published, dead-lettered).
        self._parked[key] = replace(park, draining=True)
        return None

    def settle(
        self,
        source: str,
        sent: Sequence[Message],
        retry: Mapping[MessageId, int],
        *,
        now: float,
        backoff: Callable[[int], float],
        last: MessageId | None = None,
    ) -> Settled:
        """Record a published batch whose claim ended at `last` (None: unknown); `retry`:
        id → attempts of the messages to claim again. A key that went out behind its park
        with nothing to retry is released, or drains from just after `last`."""
        first_retry: dict[str | None, Message] = {}
        for message in sent:
            if message.id in retry and message.key not in first_retry:
                first_retry[message.key] = message
        held = {
            message.id
            for message in sent
            if (first := first_retry.get(message.key)) is not None and _before(first.id, message.id)
        }
        claim_again: MessageId | None = None
        due: dict[MessageId, float] = {}
        with self._lock:
            # Keys that went out behind their park, and up to where.
            reached: dict[str | None, MessageId | None] = {}
            for message in sent:
                park = self._parked.get((source, message.key))
                if park is not None and message.key not in reached and _behind(park, message.id):
                    reached[message.key] = last if park.draining else park.id
            for key_value, first in first_retry.items():
                key = (source, key_value)
                old = self._parked.get(key)
                high = first.id if old is None else _later(first.id, old.high)
                for message in sent:
                    if message.key == key_value and message.id in held:
                        high = _later(high, message.id)
                park = Park(first.id, now + backoff(retry[first.id] - 1), high)
                self._parked[key] = park
                due[park.id] = park.due
            for key_value, upto in reached.items():
                if key_value in first_retry:
                    continue
                key = (source, key_value)
                park = self._parked[key]
                if upto is None or not _before(upto, park.high):
                    del self._parked[key]
                    continue
                self._parked[key] = Park(upto, now, park.high, draining=True)
                if isinstance(upto, int):
                    low = upto + 1
                    claim_again = low if claim_again is None else min(claim_again, low)
        return Settled(held, claim_again, due)
