"""The polling relay's rejection policy: what a batch the broker refused in part becomes. One
object shared by the workers; it never waits itself (the caller holds a transaction).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from outbox_migrate.errors import SinkCrashed, SinkError, SinkUnavailable
from outbox_migrate.relay import claimed, mark_repair, publishing, queries
from outbox_migrate.relay.bad_rows import DeadLetter, FailedMessages
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.metrics import Observer
from outbox_migrate.relay.parking import PARKED_BATCH_WAIT_S, Parking
from outbox_migrate.relay.run_stats import RelayStats, count_failures
from outbox_migrate.relay.sinks import Sink

log = logging.getLogger("outbox_migrate.relay")

_BY_ID = operator.attrgetter("id")  # claim order with key ordering


class Outcome(NamedTuple):
    acked: list[MessageId]
    letters: list[DeadLetter]
    """Dead letters written; their rows are the caller's to take out before the mark."""
    retry: list[MessageId]
    pause: float
    rewind: MessageId | None
    due: dict[MessageId, float]


class Refusals:
    def __init__(
        self,
        failures: FailedMessages,
        stats: RelayStats,
        observer: Observer,
        backoff: Callable[[int], float],
        *,
        by_key: bool,
    ) -> None:
        self.failures = failures
        self.suspects = mark_repair.Suspects()
        self.parking = Parking()
        self.stats = stats
        self.observer = observer
        self.backoff = backoff
        self.by_key = by_key

    def publish(
        self,
        conn: Any,
        sink: Sink,
        source: queries.Source,
        batch: list[Message],
        bad: list[claimed.BadRow],
        after: MessageId = 0,
    ) -> Outcome:
        """Publish a batch claimed above `after`. A refusal pauses the worker by the backoff of
        the most attempts among the refused, then claims again from the lowest; with key
        ordering it parks the key instead. The pause is taken after the COMMIT, never here:
        waiting in the transaction would hold the claimed rows' locks against a migration
        step's DDL."""
        parking, label = self.parking, source.label
        claim = sorted(batch + [b.message for b in bad], key=_BY_ID) if bad else batch
        last = claim[-1].id if claim else None
        if self.by_key and parking:  # only ever non-empty with key ordering
            send = parking.withhold(label, claim, now=time.monotonic(), after=after)[0]
            if not send:  # every message waits for its key: no busy loop meanwhile
                return Outcome([], [], [], PARKED_BATCH_WAIT_S, None, {})
            if len(send) < len(claim):
                free = {m.id for m in send}
                batch = [m for m in batch if m.id in free]
                bad = [b for b in bad if b.message.id in free]
        failures = self.failures
        worn: list[DeadLetter] = []
        sent = batch
        if failures.known:  # a crash counted the last attempt of some: dead-letter, not send
            worn = self._dead_letter_exhausted(conn, label, batch)
            if worn:
                gone = {d.message.id for d in worn}
                sent = [m for m in batch if m.id not in gone]
        try:
            rejected, unrepresentable = self._send(sink, label, sent)
        except SinkUnavailable as exc:
            partly = self._partly_sent(conn, label, exc, sent, worn, bool(bad))
            if partly is None:
                raise  # nothing acknowledged: the batch rolls back, the worker backs off
            return partly
        if not (rejected or unrepresentable or bad or worn):
            acked = list(map(_BY_ID, batch))
            if failures.known:
                self.forget(conn, label, acked)
            if self.by_key and parking:
                settled = parking.settle(label, batch, {}, now=time.monotonic(),
                                         backoff=self.backoff, last=last)  # fmt: skip
                return Outcome(acked, [], [], 0.0, settled.claim_again_from, settled.due)
            return Outcome(acked, [], [], 0.0, None, {})
        reasons = {b.message.id: b.reason for b in bad}
        reasons.update(unrepresentable)
        reasons.update(rejected)
        refused = [m for m in sent if m.id in reasons] + [b.message for b in bad]
        count_failures(self.stats, self.observer, rejected=len(rejected),
                       bad=len(reasons) - len(rejected))  # fmt: skip
        verdict = failures.record(conn, label, refused, reasons)
        letters = verdict.letters + worn
        acked = [m.id for m in sent if m.id not in reasons]
        self.forget(conn, label, acked)
        if reasons:
            log.warning("relay.rejected count=%d bad_rows=%d",
                        len(rejected), len(reasons) - len(rejected))  # fmt: skip
        if self.by_key:
            settled = parking.settle(
                label, sorted(batch + [b.message for b in bad], key=_BY_ID),
                {i: verdict.attempts[i] for i in verdict.retry},
                now=time.monotonic(), backoff=self.backoff, last=last,
            )  # fmt: skip
            held = settled.held
            return Outcome(
                [i for i in acked if i not in held], letters, [], 0.0,
                settled.claim_again_from, settled.due,
            )  # fmt: skip
        most = max((verdict.attempts[i] for i in verdict.retry if i in rejected), default=0)
        # A transient refusal gets time to clear before it counts towards the dead letters.
        pause = self.backoff(most - 1) if most else 0.0
        rewind = min(verdict.retry) if pause else None
        return Outcome(acked, letters, verdict.retry, pause, rewind, {})

    def _partly_sent(
        self,
        conn: Any,
        label: str,
        exc: SinkUnavailable,
        sent: list[Message],
        worn: list[DeadLetter],
        bad: bool,
    ) -> Outcome | None:
        """The sink failed after acknowledging some of the batch: mark those (a sink slower
        than its timeout per batch would otherwise never get further), claim the rest again.
        None (the batch rolls back): nothing acknowledged, bad rows in the batch (their
        attempts belong to its transaction), or keys parked (their release assumes it went)."""
        done = set(exc.acknowledged)
        acked = [m.id for m in sent if m.id in done]
        if not acked or bad or (self.by_key and self.parking):
            return None
        rest = [m.id for m in sent if m.id not in done]
        self.forget(conn, label, acked)
        count_failures(self.stats, self.observer, sink=1)
        log.warning("relay.sink_unavailable %s; %d of %d acknowledged and marked, the rest "
                    "claimed again", " ".join(str(exc).split()), len(acked), len(sent))  # fmt: skip
        return Outcome(acked, worn, [], self.backoff(0), min(rest, default=None), {})

    def _send(
        self, sink: Sink, label: str, batch: list[Message]
    ) -> tuple[dict[MessageId, str], dict[MessageId, str]]:
        """Publish, a message with a failure on record alone; (rejected, unrepresentable). An
        exception outside the sink's protocol becomes `SinkCrashed`, naming what it held."""
        if not self.failures.known:  # the usual batch: one part
            try:
                return publishing.publish(sink, batch)
            except SinkError:
                raise
            except Exception as exc:
                raise _crashed(sink, label, batch, exc) from exc
        parts = publishing.suspects_apart(self.failures, label, batch)
        rejected: dict[MessageId, str] = {}
        unrepresentable: dict[MessageId, str] = {}
        for i, part in enumerate(parts):
            try:
                refused, unfit = publishing.publish(sink, part)
            except SinkUnavailable as exc:
                if i == 0 or not exc.acknowledged:
                    raise
                # Earlier parts went through: acknowledged too, unless one was refused.
                clean = not (rejected or unrepresentable)
                done = [m.id for p in parts[:i] for m in p] if clean else []
                raise SinkUnavailable(exc.sink, exc.reason, done + exc.acknowledged) from exc
            except SinkError:
                raise  # a sink naming nothing here (a bug)
            except Exception as exc:
                raise _crashed(sink, label, part, exc) from exc
            rejected.update(refused)
            unrepresentable.update(unfit)
        return rejected, unrepresentable

    def _dead_letter_exhausted(
        self, conn: Any, label: str, batch: list[Message]
    ) -> list[DeadLetter]:
        """Messages out of attempts, dead-lettered in the batch's transaction (not suspects:
        `mark_repair.mark_suspects` settles those)."""
        worn = self.failures.exhausted(label, batch)
        if worn and self.suspects:
            pending = self.suspects.among(label, [m.id for m in worn])
            worn = [m for m in worn if m.id not in pending]
        return self.failures.dead_letter_exhausted(conn, label, worn) if worn else []

    def forget(self, conn: Any, label: str, acked: list[MessageId]) -> None:
        """Counters of messages that went through go, unless their mark is yet to be tried."""
        seen = self.failures.seen_before(label, acked)
        if seen and self.suspects:
            pending = self.suspects.among(label, seen)
            seen = [i for i in seen if i not in pending]
        self.failures.forget(conn, label, seen)


def _crashed(sink: Sink, label: str, part: list[Message], exc: Exception) -> SinkCrashed:
    """An exception outside the sink's protocol, naming the messages the sink held."""
    name = str(getattr(sink, "name", type(sink).__name__))
    return SinkCrashed(name, label, [m.id for m in part], exc)
