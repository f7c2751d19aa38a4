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
  stay unpublished and are claimed again (with key ordering the cursor rescans from id 0 at
  least every KEY_SHARD_RESCAN_S);
* the key is released when its parked message is acknowledged or dead-lettered, or when that
  message has not come back for PARK_STALE_S after its attempt was due (another relay
  process dealt with it after a rebalance; the key's next messages then wait that long).

Messages of every other key are sent, marked and keep flowing meanwhile, and the worker does
not pause (with `global`/`none` ordering it still pauses, see the worker). A message without a
key belongs to the one "no key" group, as the relay's key shards treat it. Pure bookkeeping,
unit-tested without a database; the relay keeps one instance shared by its workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from outbox_migrate.relay.message import Message, MessageId

PARKED_BATCH_WAIT_S = 0.05
"""A claim that brought only withheld messages waits this long before the worker goes on:
with `until_empty` the worker would otherwise rescan from id 0 in a tight loop until the
parked message is due."""
PARK_STALE_S = 30.0
"""A parked message not claimed again this long after its attempt was due is gone: with key
ordering the cursor rescans from id 0 every second or so (spaced by the rescan's cost)."""


@dataclass(frozen=True)
class Park:
    """A key waits for the message `id`, whose next attempt is due at `due` (monotonic)."""

    id: MessageId
    due: float


def _before(a: MessageId, b: MessageId) -> bool:
    """Claim order of two ids of one outbox: integers, or application ids claimed by id (the
    relay refuses key ordering when application ids are claimed by another column)."""
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    return str(a) < str(b)


class Parking:
    """Parked keys per source table; thread-safe (workers of one relay share it)."""

    def __init__(self) -> None:
        self._parked: dict[tuple[str, str | None], Park] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._parked)

    def parked(self, source: str, key: str | None) -> Park | None:
        with self._lock:
            return self._parked.get((source, key))

    def withhold(
        self, source: str, batch: Sequence[Message], *, now: float
    ) -> tuple[list[Message], list[Message]]:
        """Split a claimed batch into (to send, withheld)."""
        if not self._parked:
            return list(batch), []
        with self._lock:
            send: list[Message] = []
            withheld: list[Message] = []
            for message in batch:
                key = (source, message.key)
                park = self._parked.get(key)
                if park is not None and now > park.due + PARK_STALE_S:
                    del self._parked[key]
                    park = None
                if (
                    park is None
                    or _before(message.id, park.id)
                    or (message.id == park.id and now >= park.due)
                ):
                    send.append(message)
                else:
                    withheld.append(message)
            return send, withheld

    def settle(
        self,
        source: str,
        sent: Sequence[Message],
        retry: Mapping[MessageId, int],
        resolved: Collection[MessageId],
        *,
        now: float,
        backoff: Callable[[int], float],
    ) -> set[MessageId]:
        """Record a published batch; returns the ids of `sent` not to mark (`held`).

        `retry`: id → attempts so far of the messages to claim again; `resolved`: ids
        acknowledged or dead-lettered (their parks end).
        """
        first_retry: dict[str | None, Message] = {}
        for message in sent:
            if message.id in retry and message.key not in first_retry:
                first_retry[message.key] = message
        held: set[MessageId] = set()
        with self._lock:
            for message in sent:
                key = (source, message.key)
                park = self._parked.get(key)
                if park is not None and park.id == message.id and message.id in resolved:
                    del self._parked[key]
            for key_value, message in first_retry.items():
                self._parked[(source, key_value)] = Park(
                    message.id, now + backoff(retry[message.id] - 1)
                )
        if first_retry:
            for message in sent:
                first = first_retry.get(message.key)
                if first is not None and _before(first.id, message.id):
                    held.add(message.id)
        return held
