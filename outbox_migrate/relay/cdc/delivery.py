"""Hand a batch to the sink until every message is acknowledged or dead-lettered, by the
polling relay's policy (relay/bad_rows.py). Retries happen here, each count a short transaction
on the marks session: no transaction is open while the sink waits on the broker."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from outbox_migrate.db import one_line
from outbox_migrate.errors import OutboxMigrateError, SinkError, SinkUnavailable, crash_reason
from outbox_migrate.relay import publishing
from outbox_migrate.relay.bad_rows import DeadLetter, FailedMessages, log_dead
from outbox_migrate.relay.cdc.marks import MarkSession
from outbox_migrate.relay.mark_repair import settle_dead_ids
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.metrics import Observer
from outbox_migrate.relay.run_stats import CdcStats, count_failures
from outbox_migrate.relay.shared import close_sink
from outbox_migrate.relay.sinks import Sink, SinkFactory

log = logging.getLogger("outbox_migrate.relay")
KILLED_REASON = "the relay stopped without a trace while publishing it"


class Interrupted(OutboxMigrateError):
    """Stopped while waiting inside a batch: leave without confirming it."""


@dataclass(eq=False, kw_only=True)
class Delivery:
    """The sink's lifecycle and the retries, counting and dead-lettering of one relay."""

    sink_factory: SinkFactory
    failures: FailedMessages
    label: str
    marks: MarkSession
    stats: CdcStats
    observer: Observer
    stop: threading.Event
    backoff: Callable[[int], float]
    bad: dict[MessageId, str] = field(default_factory=dict)
    """Rows the builder could not turn into a message (its own dict)."""
    _sink: Sink | None = field(default=None, init=False)

    def deliver(self, batch: list[Message], *, careful: bool = False) -> None:
        """Publish until every message is acknowledged or dead-lettered. `SinkUnavailable`
        propagates (nothing of the batch is confirmed), and so does a sink crash once counted.
        `careful` (the last run died): each attempt is counted before the publish, so dying
        during it counts too, and taken back when acknowledged or the broker was away."""
        if self.bad:
            batch = self._set_aside(batch)
            if not batch:
                return
        if self._sink is None:
            self._sink = self.sink_factory()
        for part in publishing.suspects_apart(self.failures, self.label, batch):
            self._deliver(self._sink, part, careful)

    def _deliver(self, sink: Sink, todo: list[Message], careful: bool) -> None:
        failures, label = self.failures, self.label
        while todo:
            exhausted = failures.exhausted(label, todo)
            if exhausted:  # the relay went down during their last attempt
                with self._session() as conn:
                    letters = failures.dead_letter_exhausted(conn, label, exhausted)
                    self._out_of_the_outbox(conn, letters)
                self._dead(letters)
                gone = {d.message.id for d in letters}
                todo = [m for m in todo if m.id not in gone]
                if gone:
                    continue
            if careful:
                with self._session() as conn:
                    failures.count(conn, label, {m.id: KILLED_REASON for m in todo})
            try:
                rejected, unrepresentable = publishing.publish(sink, todo)
            except SinkError as exc:
                if careful:  # the broker's fault, not the messages'
                    self._uncount([m.id for m in todo])
                if not (isinstance(exc, SinkUnavailable) and exc.acknowledged):
                    raise  # unavailable: nothing of the batch counts as delivered
                todo = self._partly_sent(todo, exc)
                continue
            except Exception as exc:
                self._count_crash(todo, exc, counted=careful)
                raise
            if careful:  # went through: take back the attempt counted in case it killed us
                self._uncount([m.id for m in todo if m.id not in rejected
                               and m.id not in unrepresentable])  # fmt: skip
            if not (rejected or unrepresentable):
                return
            todo = self._refused(todo, rejected, unrepresentable, counted=careful)

    def _partly_sent(self, todo: list[Message], exc: SinkUnavailable) -> list[Message]:
        """The sink failed after acknowledging part of the batch: only the rest goes again,
        or a webhook slower than the timeout per batch would never get through it."""
        done = set(exc.acknowledged)
        rest = [m for m in todo if m.id not in done]
        count_failures(self.stats, self.observer, sink=1)
        log.warning("relay.sink_unavailable %s; %d of %d acknowledged, the rest sent again",
                    " ".join(str(exc).split()), len(todo) - len(rest), len(todo))  # fmt: skip
        if rest and self.stop.wait(self.backoff(0)):
            raise Interrupted from None
        return rest

    def _refused(
        self,
        todo: list[Message],
        rejected: Mapping[MessageId, str],
        unrepresentable: Mapping[MessageId, str],
        *,
        counted: bool,
    ) -> list[Message]:
        """Count the refused messages' attempts, dead-letter those at the limit, back off
        after a rejection (not for an unrepresentable one); returns those to publish again."""
        count_failures(self.stats, self.observer, rejected=len(rejected), bad=len(unrepresentable))
        reasons = {**unrepresentable, **rejected}
        refused = [m for m in todo if m.id in reasons]
        with self._session() as conn:
            verdict = self.failures.record(conn, self.label, refused, reasons, counted=counted)
            self._out_of_the_outbox(conn, verdict.letters)
        self._dead(verdict.letters)
        retry = [m for m in refused if m.id in verdict.retry]
        log.warning("relay.rejected count=%d bad_rows=%d dead_lettered=%d",
                    len(rejected), len(unrepresentable), len(verdict.dead))  # fmt: skip
        most = max((verdict.attempts[m.id] for m in retry if m.id in rejected), default=0)
        # A transient refusal gets time to clear before it counts again.
        if most and self.stop.wait(self.backoff(most - 1)):
            raise Interrupted from None
        return retry

    def _uncount(self, ids: list[MessageId]) -> None:
        if ids:
            with self._session() as conn:
                self.failures.uncount(conn, self.label, ids)

    def _count_crash(self, todo: list[Message], exc: Exception, *, counted: bool) -> None:
        """The sink raised outside its protocol: the attempt counts against the messages it
        held (relay/bad_rows.py says why)."""
        reasons = dict.fromkeys((m.id for m in todo), crash_reason(exc))
        try:
            with self._session() as conn:  # `counted` before the publish: the reason is new
                self.failures.record(conn, self.label, [], reasons, counted=counted)
        except (psycopg.Error, OutboxMigrateError) as failed:
            log.warning("relay.attempts_not_counted %s", one_line(str(failed)))

    def _set_aside(self, batch: list[Message]) -> list[Message]:
        """Dead-letter the batch's bad rows at once, whatever `max_attempts`: the stream
        cannot offer them again, and they would fail the same way every time."""
        bad = [m for m in batch if m.id in self.bad]
        if not bad:
            return batch
        reasons = {m.id: self.bad.pop(m.id) for m in bad}
        count_failures(self.stats, self.observer, bad=len(bad))
        with self._session() as conn:
            verdict = self.failures.record(conn, self.label, bad, reasons, now=True)
            self._out_of_the_outbox(conn, verdict.letters)
        self._dead(verdict.letters)
        return [m for m in batch if m.id not in reasons]

    def _out_of_the_outbox(self, conn: Any, letters: list[DeadLetter]) -> None:
        """Dead-lettered rows leave the unpublished partition in the dead letters'
        transaction (docs/relay.md, "Dead letters"), deleted where the role may, as polling
        does; the stream's later mark finds nothing of them."""
        if letters:
            settle_dead_ids(conn, self.marks.source, [d.message.id for d in letters])

    def _dead(self, letters: list[DeadLetter]) -> None:
        """Dead letters whose transaction committed: counted and logged (never before)."""
        self.stats.add(dead_lettered=len(letters))
        log_dead(letters)

    @contextmanager
    def _session(self) -> Iterator[Any]:
        """The marks session (no mark in flight), in a short transaction of its own."""
        conn = self.marks.session()
        with conn.transaction():
            yield conn

    def close(self) -> None:
        close_sink(self._sink)
        self._sink = None
