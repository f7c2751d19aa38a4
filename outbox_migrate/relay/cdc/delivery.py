"""Hand a batch to the sink until every message is acknowledged or dead-lettered.

The sink is the only thing here that waits on the broker, and nothing here holds a database
transaction while it does: failed attempts are counted (`rejections`) in their own short
statements on the marks session, between publishes. A message with a failure on record is
published on its own, so that a crash it causes again is counted against it, not its batch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import psycopg

from outbox_migrate.db import one_line
from outbox_migrate.errors import OutboxMigrateError
from outbox_migrate.relay.cdc.marks import MarkSession
from outbox_migrate.relay.cdc.rejections import RejectionLedger
from outbox_migrate.relay.cdc.stats import CdcStats
from outbox_migrate.relay.errors import MessagesRejected, SinkError
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.metrics import Observer
from outbox_migrate.relay.sinks import Sink, SinkFactory

log = logging.getLogger("outbox_migrate.relay")
KILLED_REASON = "the relay stopped without a trace while publishing it"
"""The last error of an attempt counted before a careful publish, until the sink says more."""


class Interrupted(OutboxMigrateError):
    """Stopped while waiting inside a batch: leave without confirming it."""


class Delivery:
    """The sink's lifecycle and the retries, counting and dead-lettering of one relay."""

    def __init__(
        self,
        sink_factory: SinkFactory,
        ledger: RejectionLedger,
        marks: MarkSession,
        *,
        stats: CdcStats,
        observer: Observer,
        stop: threading.Event,
        backoff: Callable[[int], float],
        bad: dict[MessageId, str] | None = None,
    ) -> None:
        self.sink_factory = sink_factory
        self.bad: dict[MessageId, str] = {} if bad is None else bad
        """Rows the builder could not turn into a message as they are (the builder's own
        dict): dead-lettered with their reason at once — the stream cannot offer them again,
        and the same row would fail the same way every time."""
        self.ledger = ledger
        self.marks = marks
        self.stats = stats
        self.observer = observer
        self.stop = stop
        self.backoff = backoff
        self._sink: Sink | None = None

    def deliver(self, batch: list[Message], *, careful: bool = False) -> None:
        """Publish until every message is acknowledged or dead-lettered; `SinkUnavailable`
        propagates (the caller drops the stream: nothing of this batch is confirmed), and so
        does any other exception of the sink, once it is counted against the batch.

        `careful` (after a run that died without a trace, `crash_guard`): each attempt is
        counted before the publish, so that dying during it counts too."""
        if self.bad:
            batch = self._set_aside(batch)
            if not batch:
                return
        if self._sink is None:
            self._sink = self.sink_factory()
        ledger = self.ledger
        if ledger.known and any(ledger.suspect(m.id) for m in batch):
            for part in _isolate(batch, ledger.suspect):
                self._deliver(self._sink, part, careful)
        else:
            self._deliver(self._sink, batch, careful)

    def _deliver(self, sink: Sink, todo: list[Message], careful: bool) -> None:
        ledger = self.ledger
        while todo:
            exhausted = ledger.exhausted(todo)
            if exhausted:  # the relay went down during their last attempt
                self._dead_letter(exhausted)
                gone = {m.id for m in exhausted}
                todo = [m for m in todo if m.id not in gone]
                continue
            if careful:
                ledger.count(self.marks.session(), {m.id: KILLED_REASON for m in todo})
            try:
                sink.publish(todo)
            except MessagesRejected as exc:
                todo = self._rejected(todo, exc, counted=careful)
            except SinkError:
                if careful:  # the broker's fault, not the messages'
                    ledger.uncount(self.marks.session(), [m.id for m in todo])
                raise  # unavailable: nothing of the batch counts as delivered
            except Exception as exc:
                self._count_crash(todo, exc, counted=careful)
                raise
            else:
                self._forget([m.id for m in todo])
                return

    def _rejected(
        self, todo: list[Message], exc: MessagesRejected, *, counted: bool
    ) -> list[Message]:
        """Count the refused messages' attempts (unless `counted` already), dead-letter those
        at the limit, back off; returns the ones to publish again."""
        ledger = self.ledger
        self.observer.failed("rejected", len(exc.rejected))
        refused = [m for m in todo if m.id in exc.rejected]
        self._forget([m.id for m in todo if m.id not in exc.rejected])
        if not refused:
            return []
        reasons = {m.id: exc.rejected[m.id] for m in refused}
        conn = self.marks.session()
        attempts = ledger.note(conn, reasons) if counted else ledger.count(conn, reasons)
        dead = [m for m in refused if attempts[m.id] >= ledger.max_attempts]
        retry = [m for m in refused if attempts[m.id] < ledger.max_attempts]
        log.warning("relay.rejected count=%d dead_lettered=%d", len(refused), len(dead))
        if dead:
            self._dead_letter(dead)
        if retry:
            # A transient refusal gets time to clear before it counts again.
            most = max(attempts[m.id] for m in retry)
            if self.stop.wait(self.backoff(most - 1)):
                raise Interrupted from None
        return retry

    def _forget(self, acked: list[MessageId]) -> None:
        """Counters of messages that went through after all. The marks session is asked for
        only when there is one: it waits for the mark in flight."""
        ids = [i for i in acked if self.ledger.suspect(i)] if self.ledger.known else []
        if ids:
            self.ledger.forget(self.marks.session(), ids)

    def _count_crash(self, todo: list[Message], exc: Exception, *, counted: bool) -> None:
        """The sink raised something it should not: the relay stops, and the attempt counts
        against the messages it held, so a message that crashes the relay every time reaches
        the dead-letter table after `max_attempts` restarts."""
        reason = f"{type(exc).__name__}: {exc}"
        reasons = {m.id: reason for m in todo}
        try:
            conn = self.marks.session()
            if counted:  # counted before the publish: only the reason is new
                self.ledger.note(conn, reasons)
            else:
                self.ledger.count(conn, reasons)
        except (psycopg.Error, OutboxMigrateError) as failed:
            log.warning("relay.attempts_not_counted %s", one_line(str(failed)))

    def _set_aside(self, batch: list[Message]) -> list[Message]:
        """Dead-letter the batch's bad rows with their reason; the rest go on. (The caller
        marks the whole batch afterwards, as for any dead-lettered message.)"""
        bad = [m for m in batch if m.id in self.bad]
        if not bad:
            return batch
        reasons = {m.id: self.bad.pop(m.id) for m in bad}
        self.ledger.count(self.marks.session(), reasons)
        self.observer.failed("bad_row", len(bad))
        self._dead_letter(bad)
        return [m for m in batch if m.id not in reasons]

    def _dead_letter(self, messages: list[Message]) -> None:
        known = self.ledger.known
        attempts = [(m.id, known.get(m.id, (0, ""))[0]) for m in messages]
        self.ledger.dead_letter(self.marks.session(), messages)
        self.stats.add(dead_lettered=len(messages))
        for message_id, count in attempts:
            log.warning("relay.dead_lettered id=%s attempts=%d", message_id, count)

    def close(self) -> None:
        if self._sink is not None:
            try:
                self._sink.close()
            except Exception:  # a broken sink is replaced, not fatal
                log.debug("relay.sink_close_failed", exc_info=True)
            self._sink = None


def _isolate(batch: list[Message], suspect: Callable[[MessageId], bool]) -> Iterator[list[Message]]:
    """The batch in order, each suspect alone, the messages between them together."""
    run: list[Message] = []
    for m in batch:
        if suspect(m.id):
            if run:
                yield run
                run = []
            yield [m]
        else:
            run.append(m)
    if run:
        yield run
