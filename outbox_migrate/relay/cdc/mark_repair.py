"""A CDC mark that breaks a constraint: mark the rest, count the rows at fault, never stop.

The CDC mark is one UPDATE for a mark interval's ids: one row that cannot move fails it for
all, and every restart would re-stream and fail the same rows. As in the polling relay
(relay/mark_repair.py, whose bisection this uses), the rows are locked and marked again by
ctid in halves (by ctid: two unpublished copies of one id are two rows). Each failing row
counts one attempt (relay/bad_rows.py); at the last it is dead-lettered with its own content
and deleted.

An unsettled row stays `pending`: tried again alone before each later mark (no backoff:
waiting does not change a row), and the slot is not confirmed past it, so a crash re-streams
it and the count goes on from the database. A row locked by another session is skipped and
stays pending without an attempt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay import queries
from outbox_migrate.relay.bad_rows import DeadLetter, FailedMessages, log_dead
from outbox_migrate.relay.cdc.messages import RowReader
from outbox_migrate.relay.mark_repair import mark_in_halves, remove_dead
from outbox_migrate.relay.message import MessageId
from outbox_migrate.relay.metrics import Observer
from outbox_migrate.relay.run_stats import CdcStats
from outbox_migrate.sql import query

log = logging.getLogger("outbox_migrate.relay")


class MarkRepair:
    """Rows of the CDC relay's marks that failed on a constraint, until each is settled."""

    def __init__(
        self,
        failures: FailedMessages,
        label: str,
        reader: Callable[[Any], RowReader],
        *,
        stats: CdcStats,
        observer: Observer,
    ) -> None:
        self.failures = failures
        self.label = label
        self._new_reader = reader
        self._reader: RowReader | None = None
        self.stats = stats
        self.observer = observer
        self.pending: set[MessageId] = set()
        """Ids with a row whose mark failed and that is neither marked nor dead-lettered."""
        self._source: queries.Source | None = None

    def use_spec(self, spec: OutboxSpec, claim_oid: int = 0) -> None:
        """The resolved spec and the unpublished partition's OID the repair is confined to."""
        self._source = replace(queries.partitioned_source(spec), claim_oid=claim_oid)

    @property
    def available(self) -> bool:
        """Without the attempts table a failing row cannot be counted: the error stops the relay."""
        return self.failures.available and self._source is not None

    def after_failure(self, conn: Any, ids: Collection[MessageId], error: str) -> None:
        """The mark of `ids` failed on a constraint (`error`): mark what can be marked."""
        log.warning("relay.cdc_mark_failed ids=%d %s", len(ids), error)
        self._settle(conn, ids, whole=True)

    def retry(self, conn: Any) -> None:
        """Each pending row alone again: marked, or one more attempt."""
        if self.pending:
            self._settle(conn, sorted(self.pending), whole=False)

    def forget_marked(self, conn: Any, ids: Collection[MessageId]) -> None:
        """Marked: their counters go — only now, not at the broker's ack: a crash before the
        mark re-streams them, and the count must still be there."""
        failures = self.failures
        if failures.known:
            seen = [i for i in failures.seen_before(self.label, list(ids)) if i not in self.pending]
            if seen:
                failures.forget(conn, self.label, seen)

    def _settle(self, conn: Any, ids: Collection[MessageId], *, whole: bool) -> None:
        source = self._source
        assert source is not None  # `available` was asked first
        letters: list[DeadLetter] = []
        with conn.transaction():
            # A deferred constraint would fail at COMMIT, for all rows again.
            conn.execute("SET CONSTRAINTS ALL IMMEDIATE")
            rows = conn.execute(_lock(source, skip=True), {"ids": list(ids)}).fetchall()
            tids = {str(tid): int(ident) for tid, ident in rows}
            seen = conn.execute(_lock(source, skip=False), {"ids": list(ids)}).fetchall()
            busy = {int(ident) for tid, ident in seen if str(tid) not in tids}
            alone = [tid for tid, ident in tids.items() if not whole or ident in self.pending]
            rest = [tid for tid in tids if tid not in alone]
            failed: dict[str, str] = {}
            for tid in alone:
                failed.update(mark_in_halves(conn, source, [tid]))
            if rest:
                failed.update(mark_in_halves(conn, source, rest))
            marked = {tids[tid] for tid in tids if tid not in failed}
            if failed:
                letters = self._count(conn, source, failed, tids)
            dead = {d.message.id for d in letters}
            still = {tids[tid] for tid in failed if tids[tid] not in dead}
            self.pending = (self.pending - set(ids)) | still | busy
            self.forget_marked(conn, marked)
        # Committed: only now are the dead letters facts to report.
        self.stats.add(marked=len(tids) - len(failed))
        if failed:
            self.stats.add(dead_lettered=len(letters), bad_rows=len(failed))
            self.observer.failed("bad_row", len(failed))
            log.warning("relay.cdc_mark_repaired bad_rows=%d dead_lettered=%d", len(failed),
                        len(letters))  # fmt: skip
            log_dead(letters)
        if busy:
            log.info("relay.cdc_mark_deferred ids=%d: rows locked by another session", len(busy))

    def _count(
        self, conn: Any, source: queries.Source, failed: dict[str, str], tids: dict[str, int]
    ) -> list[DeadLetter]:
        """One attempt per failing id; at the last, each failing copy is dead-lettered with
        its own content and leaves the outbox."""
        if self._reader is None:
            self._reader = self._new_reader(conn)
        messages = self._reader.by_ctids(conn, list(failed))
        reasons: dict[MessageId, str] = {tids[tid]: r for tid, r in failed.items()}
        verdict = self.failures.record(
            conn, self.label, [messages[tid] for tid in failed if tid in messages], reasons,
            delivered=True,
        )  # fmt: skip
        dead = {m.id for m in verdict.dead}
        gone = {tid: why for tid, why in failed.items() if tids[tid] in dead}
        if gone:
            remove_dead(conn, source, gone)
        return verdict.letters


def _lock(source: queries.Source, *, skip: bool) -> sql.Composed:
    """ctid and id of the unpublished rows with these ids: locked skipping others' (`skip`),
    or just read (to find the ones skipped)."""
    ident = sql.Identifier(source.id_column)
    locking = sql.SQL(" ORDER BY {}, ctid FOR UPDATE SKIP LOCKED").format(ident)
    return query("cdc", "repair-lock").compose(
        table=source.claim_ident,
        id=ident,
        same=source.same_relation(),
        locking=locking if skip else sql.SQL(""),
    )
