"""A CDC mark that breaks a constraint: mark the rest, count the rows at fault, never stop.

The CDC mark is one `UPDATE … WHERE id = ANY(…)` for everything acknowledged in a mark
interval. After the swap the old table, with its primary key, is the published partition: a
row whose id is already there cannot be moved, and the UPDATE failed for all of them — the
relay stopped, and every restart re-streamed and failed the same rows (a crash loop). Here, as
in the polling relay (relay/mark_repair.py, whose bisection this uses), the rows of the failed
mark are locked by id and marked again by ctid in halves, each half in a savepoint, until the
failing rows stand alone; by ctid, because two unpublished copies of one id are two rows, of
which the first may move and the second not. Each failing row counts one attempt
(relay/bad_rows.py, shared with the polling relay); at `max_attempts` it is kept in the
dead-letter table with the SQLSTATE and the constraint's message, its content read back from
the row itself (each copy its own), and deleted from the outbox — it cannot be marked.

A row not yet settled stays `pending`: it is tried again alone before each later mark (one
attempt each time, no backoff: waiting does not change a row), and the stream session does not
confirm the slot while any row is pending (relay/cdc/session.py) — the confirmed position
never passes a row that is neither marked nor dead-lettered, so a crash meanwhile re-streams
it and the count goes on from the database.

Runs on the marks session, in one short transaction per call, with no mark in flight; a row
another session holds locked is skipped (`SKIP LOCKED`) and stays pending without an attempt.
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
from outbox_migrate.relay.cdc.rows import RowReader
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
        """The spec with its marker resolved and its unpublished partition's OID (the marks
        session's): the repair's marks and locks are confined to that relation."""
        self._source = replace(queries.partitioned_source(spec), claim_oid=claim_oid)

    @property
    def available(self) -> bool:
        """Without the attempts table a failing row cannot be counted: the mark's error
        stops the relay, as it did before."""
        return self.failures.available and self._source is not None

    # -- the marks session calls ---------------------------------------------------------

    def after_failure(self, conn: Any, ids: Collection[MessageId], error: str) -> None:
        """The mark of `ids` failed on a constraint (`error`): mark what can be marked."""
        log.warning("relay.cdc_mark_failed ids=%d %s", len(ids), error)
        self._settle(conn, ids, whole=True)

    def retry(self, conn: Any) -> None:
        """Each pending row alone again: marked, or one more attempt (dead-lettered at the
        last)."""
        if self.pending:
            self._settle(conn, sorted(self.pending), whole=False)

    def forget_marked(self, conn: Any, ids: Collection[MessageId]) -> None:
        """Marked: the counters of those that failed before go (a careful start's count, a
        rejection, a sink crash). Only here, not when the broker acknowledged them: a crash
        before the mark re-streams them, and the count must still be there."""
        failures = self.failures
        if failures.known:
            seen = [i for i in failures.seen_before(self.label, list(ids)) if i not in self.pending]
            if seen:
                failures.forget(conn, self.label, seen)

    # -- the repair ------------------------------------------------------------------------

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
        """One attempt per id with a failing row (each after a delivery); at the last, every
        failing copy goes to the dead letters with its own content and leaves the outbox.
        Returns the dead letters written."""
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
    """The unpublished rows with these ids (param: ids): ctid and id — locked, skipping
    those another session holds (`skip`), or just read (to find the ones skipped)."""
    ident = sql.Identifier(source.id_column)
    locking = sql.SQL(" ORDER BY {}, ctid FOR UPDATE SKIP LOCKED").format(ident)
    return query("cdc", "repair-lock").compose(
        table=source.claim_ident,
        id=ident,
        same=source.same_relation(),
        locking=locking if skip else sql.SQL(""),
    )
