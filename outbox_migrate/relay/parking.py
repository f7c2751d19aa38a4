"""`--ordering key` and rejected messages: a refused message parks its key, the others flow.

Without this, a rejected message was simply claimed again later while the rest of its batch,
later messages of the *same* key included, was marked published: consumers saw a key's
message n+1 before message n (which might then only reach the dead-letter table). With key
ordering the promise is per key, so:

* after a batch, for every key with a message to retry (rejected, not yet dead-lettered), the
  key is *parked* at that message's id until its next attempt is due (the relay's backoff for
  its attempts so far); messages of that key after it in the same batch are not marked
  (`held`) — they were sent once and will be sent again after it, de-duplicated downstream on
  the outbox id, as after any at-least-once retry;
* before a batch is published, messages of a parked key with a higher id, and the parked
  message itself before its attempt is due, are *withheld*: neither sent nor marked, so they
  stay unpublished and are claimed again: the worker's cursor claims from just below the
  parked message when its attempt is due (`Settled.due`, `Cursor.retry_at`) — on a clock,
  not at the next rescan from id 0, which the rescan's own cost spaces out under load;
* withheld and held messages lie *below* the cursor, which went on claiming newer ones: a
  parked key's messages therefore go out only in a batch whose claim reached back to the
  park (it started below it), where they come in id order ahead of any newer one. Released
  only then, and only once that claim also reached the highest id the key left behind; else
  the key *drains*: parked just after the claim's last id, due at once, and the worker's
  cursor claims again from there. Without this a newer message claimed above the cursor went
  out at once, the held-back ones only with a later claim from below;
* a park ends early when its message has not come back for PARK_STALE_S after its attempt
  was due (another relay process dealt with it after a rebalance; the key's next messages
  then wait that long).

Messages of every other key are sent, marked and keep flowing meanwhile, and the worker does
not pause (with `global`/`none` ordering it still pauses, see the worker). A message without a
key belongs to the one "no key" group, as the relay's key shards treat it. Pure bookkeeping,
unit-tested without a database; the relay keeps one instance shared by its workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from outbox_migrate.relay.message import Message, MessageId

PARKED_BATCH_WAIT_S = 0.05
"""A claim that brought only withheld messages waits this long before the worker goes on:
with `until_empty` the worker would otherwise rescan from id 0 in a tight loop until the
parked message is due."""
PARK_STALE_S = 30.0
"""A parked message not claimed again this long after its attempt was due is gone: the
worker's cursor claims from just below it when it is due, and every rescan from id 0 reaches
it too, so only a message another relay process took (its shard moved) stays away."""


@dataclass(frozen=True)
class Park:
    """A key waits: for the message `id`, whose next attempt is due at `due` (monotonic), or —
    `draining` — for its messages after `id`, held back while it was parked, to be claimed
    again from below (`id` is then the last id a batch that carried the key covered).

    `high` is the highest id of the key known to be left unpublished behind the park (the
    parked message itself, messages held or withheld since): the key is released only by a
    batch whose claimed range reached it, since those messages now lie below the cursor.
    """

    id: MessageId
    due: float
    high: MessageId
    draining: bool = False


class Settled(NamedTuple):
    """What a published batch leaves: `held`, ids of sent messages not to mark (they follow a
    message of their key to retry); `claim_again_from`, the lowest id the worker's cursor
    must claim from again (a released key's held-back messages lie below it), or None;
    `due`, the messages it parked and when each is due again (monotonic): the worker's cursor
    claims from just below each then (`Cursor.retry_at`)."""

    held: set[MessageId]
    claim_again_from: MessageId | None
    due: dict[MessageId, float]


def _before(a: MessageId, b: MessageId) -> bool:
    """Claim order of two ids of one outbox: integers, or application ids claimed by id (the
    relay refuses key ordering when application ids are claimed by another column)."""
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    return str(a) < str(b)


def _later(a: MessageId, b: MessageId) -> MessageId:
    return b if _before(a, b) else a


def _behind(park: Park, message_id: MessageId) -> bool:
    """Whether a message of the parked key waits behind the park (is not earlier than it)."""
    return _before(park.id, message_id) if park.draining else not _before(message_id, park.id)


def _covers(after: MessageId, park: Park) -> bool:
    """Whether a claim of every unpublished row above `after` (0: from the start, as every
    claim of application ids is) reaches back to the park: then the key's held-back messages
    are in the batch, in id order, ahead of any newer one."""
    if after == 0 or not (isinstance(after, int) and isinstance(park.id, int)):
        return True
    return after <= park.id if park.draining else after < park.id


class Parking:
    """Parked keys per source table; thread-safe (workers of one relay share it; a key belongs
    to one worker's shards at a time)."""

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
        """Split a batch claimed above `after` into (to send, withheld).

        A parked key's messages go out only when its park is due *and* the claim reached back
        to it: a message claimed above the cursor while the key's held-back messages lie below
        it would otherwise overtake them (they came only with the next rescan from id 0). A
        parked message due again goes out alone among its key's messages: refused once more,
        nothing of its key would have reached the broker ahead of it; acknowledged, the key
        drains from just after it (`settle`)."""
        if not self._parked:
            return list(batch), []
        with self._lock:
            send: list[Message] = []
            withheld: list[Message] = []
            bound: dict[str | None, Park | None] = {}
            """Per key of this batch: up to where (inclusive) its messages may go, None: all."""
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
        """The park a key's messages in this batch must stay behind (None: send them all)."""
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
        """Record a published batch whose claim ended at id `last` (None: unknown).

        `retry`: id → attempts so far of the messages to claim again (every other sent message
        was acknowledged or dead-lettered). A key whose messages behind its park went out
        (`withhold` let them) and none of which is to retry has delivered everything up to
        `last`: it is released when nothing of it is known to wait beyond `last`, else it
        drains — parked just after `last`, due at once — and the cursor claims again from
        there, so those messages go out before any newer one of the key.
        """
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
            # Keys whose messages behind their park went out (`withhold` let them), and up to
            # where that delivered them: the batch's last id, or the parked message sent alone.
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
