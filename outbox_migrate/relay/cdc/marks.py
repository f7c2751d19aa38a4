"""The CDC relay's second session: the marks (and the short bad-row transactions between them).

Each statement is its own transaction (autocommit). A failure other than a broken constraint
stops the relay; a broken one is repaired here (docs/relay.md, "CDC mode").
"""

from __future__ import annotations

import logging
import select
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.db import one_line
from outbox_migrate.errors import RelayFailed
from outbox_migrate.patterns import marker
from outbox_migrate.relay import queries
from outbox_migrate.relay.bad_rows import DeadLetter, FailedMessages, log_dead
from outbox_migrate.relay.cdc.messages import RowReader
from outbox_migrate.relay.mark_repair import mark_in_halves, remove_dead
from outbox_migrate.relay.marker_source import check_names
from outbox_migrate.relay.message import MessageId
from outbox_migrate.relay.metrics import Observer
from outbox_migrate.relay.run_stats import CdcStats, count_failures
from outbox_migrate.relay.shared import close_quietly
from outbox_migrate.sql import query

log = logging.getLogger("outbox_migrate.relay")
MARK_STATEMENT = b"outbox_migrate_cdc_mark"


@dataclass(eq=False, kw_only=True)
class MarkRepair:
    """Rows of the CDC relay's marks that failed on a constraint, until each is settled."""

    failures: FailedMessages
    label: str
    reader: Callable[[Any], RowReader]
    stats: CdcStats
    observer: Observer
    pending: set[MessageId] = field(default_factory=set)
    """Ids with a row whose mark failed and that is neither marked nor dead-lettered."""
    _rows: RowReader | None = field(default=None, init=False)

    def after_failure(
        self, conn: Any, source: queries.Source, ids: Collection[MessageId], error: str
    ) -> None:
        """The mark of `ids` failed on a constraint (`error`): mark what can be marked."""
        log.warning("relay.cdc_mark_failed ids=%d %s", len(ids), error)
        self._settle(conn, source, ids, whole=True)

    def retry(self, conn: Any, source: queries.Source) -> None:
        """Each pending row alone again, before every later mark (no backoff: waiting does not
        change a row): marked, or one more attempt."""
        if self.pending:
            self._settle(conn, source, sorted(self.pending), whole=False)

    def forget_marked(self, conn: Any, ids: Collection[MessageId]) -> None:
        """Marked: their counters go — only now, not at the broker's ack: a crash before the
        mark re-streams them, and the count must still be there."""
        seen = self.failures.seen_before(self.label, list(ids))
        self.failures.forget(conn, self.label, [i for i in seen if i not in self.pending])

    def _settle(
        self, conn: Any, source: queries.Source, ids: Collection[MessageId], *, whole: bool
    ) -> None:
        letters: list[DeadLetter] = []
        with conn.transaction():
            # A deferred constraint would fail at COMMIT, for all rows again.
            conn.execute("SET CONSTRAINTS ALL IMMEDIATE")
            # By ctid, not id: two unpublished copies of one id are two rows. A row locked by
            # another session is skipped and stays pending, without an attempt.
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
            count_failures(self.stats, self.observer, bad=len(failed), dead=len(letters))
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
        if self._rows is None:
            self._rows = self.reader(conn)
        messages = self._rows.by_ctids(conn, list(failed))
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


@dataclass(eq=False, kw_only=True)
class MarkSession:
    """One normal session of the relay: marks, one at a time, and bad-row bookkeeping."""

    connect: Callable[[], Any]
    source: queries.Source
    """The unpublished partition, with its OID once resolved (`use_source`)."""
    enabled: bool
    stats: CdcStats
    repair: MarkRepair
    unseen: set[int] = field(default_factory=set, init=False)
    """Transactions the last mark's snapshot did not show: to mark again."""
    _sent: list[MessageId] = field(default_factory=list, init=False)
    _xids: list[int] = field(default_factory=list, init=False)
    """The 32-bit xids of the mark in flight, as the stream names them."""
    _conn: Any = field(default=None, init=False)
    _sql: bytes | None = field(default=None, init=False)
    _in_flight: bool = field(default=False, init=False)

    def use_source(self, source: queries.Source) -> None:
        """The resolved spec's source, with the unpublished partition's OID at start: every
        mark is confined to that relation, whatever the names mean by then."""
        self.source = source
        self._sql = None

    @property
    def unresolved(self) -> bool:
        """A failed mark's row is unsettled: the slot must not be confirmed past it."""
        return bool(self.repair.pending)

    def session(self) -> Any:
        """The connection, with no mark in flight (it carries one statement at a time)."""
        self.wait()
        return self._open()

    def mark(self, ids: Sequence[MessageId], xids: Iterable[int] = ()) -> None:
        """Mark and wait (the first start's backlog; the stream uses `send`)."""
        if self.send(ids, xids):
            self.wait()

    def settle(self, stop: threading.Event) -> None:
        """Wait for the mark in flight, then retry failed rows until settled (one attempt a
        round: at most `max_attempts` rounds) or `stop`."""
        self.wait()
        repair = self.repair
        for _ in range(repair.failures.max_attempts + 1):
            if not self.unresolved or stop.is_set():
                return
            repair.retry(self._open(), self.source)

    def send(self, ids: Sequence[MessageId], xids: Iterable[int] = ()) -> bool:
        """Send the mark of `ids` without waiting (False: nothing to send); one in flight at
        a time. Failed rows are retried alone first and left out. `xids`: the inserting
        transactions, checked against the mark's snapshot. `--no-mark`: only the counters go."""
        self.unseen = set()
        if not self.enabled:
            if ids and self.repair.failures.known:
                self.repair.forget_marked(self.session(), ids)
            return False
        if self._in_flight:
            raise RuntimeError("a mark is already in flight")  # a bug, not an input error
        repair = self.repair
        if repair.pending:
            retried = set(repair.pending)
            repair.retry(self._open(), self.source)
            ids = [i for i in ids if i not in retried]
        if not ids:
            return False
        conn = self._open()
        pgconn = conn.pgconn
        if self._sql is None:
            # Prepared once and run through libpq: the cursor API cost more CPU per batch
            # than the rest of the loop (bench/README.md, cdc.py).
            source = self.source
            self._sql = (
                query("cdc", "mark")
                .compose(
                    table=source.mark_ident,
                    mark=marker.mark(source.marker),
                    id=sql.Identifier(source.id_column),
                    unpublished=marker.unpublished(source.marker),
                    same=source.same_relation(),
                )
                .as_bytes(conn)
            )
            _check(pgconn.prepare(MARK_STATEMENT, self._sql), pgconn)
        # The ids as one int8[] literal: no per-element adaptation.
        literal = ("{" + ",".join(map(str, ids)) + "}").encode()
        try:
            pgconn.send_query_prepared(MARK_STATEMENT, [literal])
            while pgconn.flush() == 1:  # the statement did not fit the socket buffer
                select.select([pgconn.socket], [pgconn.socket], [], 1.0)
        except psycopg.Error as exc:
            raise psycopg.OperationalError(one_line(str(exc))) from None
        self._in_flight = True
        self._sent = list(ids)
        self._xids = list(xids)
        self.stats.add(marks=1)
        return True

    def socket(self) -> int | None:
        """The socket while a mark is in flight: the stream loop waits on it too."""
        if not self._in_flight or self._conn is None:
            return None
        fd: int = self._conn.pgconn.socket
        return fd

    def done(self) -> bool:
        """Collect the mark in flight if its result has arrived (never blocks)."""
        if not self._in_flight:
            return True
        pgconn = self._conn.pgconn
        try:
            pgconn.consume_input()
        except psycopg.Error as exc:
            raise psycopg.OperationalError(one_line(str(exc))) from None
        if pgconn.is_busy():
            return False
        self._collect(pgconn)
        return True

    def wait(self) -> None:
        while not self.done():
            select.select([self._conn.pgconn.socket], [], [], 1.0)

    def _collect(self, pgconn: Any) -> None:
        self._in_flight = False
        result = pgconn.get_result()
        while pgconn.get_result() is not None:  # drain to the end of the statement
            pass
        if result is None:
            raise psycopg.OperationalError(
                pgconn.error_message.decode(errors="replace").strip() or "mark: no result"
            )
        sent, self._sent = self._sent, []
        xids, self._xids = self._xids, []
        repair = self.repair
        # Without the attempts table a failing row cannot be counted: the error stops the relay.
        if repair.failures.available and _broke_a_constraint(result, pgconn):
            repair.after_failure(self._open(), self.source, sent, _error(result, pgconn))
            return
        result = _check(result, pgconn, rows=True)
        changed = int(result.get_value(0, 0) or 0)
        self.stats.add(marked=changed)
        if xids:
            snapshot = (result.get_value(0, 1) or b"").decode()
            # The stream carries a commit a moment before other sessions see it: transactions
            # this snapshot did not show are marked again before the slot passes them.
            self.unseen = {x for x in xids if not visible(x, snapshot)}
        if changed < len(sent):
            # Marked already, not visible yet, or the names moved: then stop (`NamesMoved`).
            check_names(self._open(), self.source)
        if repair.failures.known:
            repair.forget_marked(self._open(), sent)

    def _open(self) -> Any:
        if self._conn is None or self._conn.closed:
            self._conn = self.connect()
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            close_quietly(self._conn)
            self._conn = None
            self._sql = None
            self._in_flight = False
            self._sent = []
            self._xids = []


def visible(xid: int, snapshot: str) -> bool:
    """Whether the 32-bit `xid` had ended for `snapshot` (`xmin:xmax:xip,…`, 64-bit xids),
    widened against xmax: a transaction the stream sent lies within 2^31 of it."""
    xmin_text, xmax_text, xip_text = snapshot.split(":")
    xmin, xmax = int(xmin_text), int(xmax_text)
    behind = ((xmax & 0xFFFFFFFF) - xid) % (1 << 32)
    if behind == 0 or behind > (1 << 31):
        return False  # at or past xmax: not ended when the snapshot was taken
    full = xmax - behind
    return full < xmin or str(full) not in xip_text.split(",")


def _check(result: Any, pgconn: Any, *, rows: bool = False) -> Any:
    from psycopg import pq

    if result.status != (pq.ExecStatus.TUPLES_OK if rows else pq.ExecStatus.COMMAND_OK):
        message = _error(result, pgconn)
        if pgconn.status != pq.ConnStatus.OK:
            raise psycopg.OperationalError(message)
        # A runtime fault, not bad input (exit 1): a constraint is repaired before this.
        raise RelayFailed(f"cannot mark published rows: {message}")
    return result


def _error(result: Any, pgconn: Any) -> str:
    return one_line((result.error_message or pgconn.error_message).decode(errors="replace"))


def _broke_a_constraint(result: Any, pgconn: Any) -> bool:
    """SQLSTATE class 23 on a healthy session: a row's problem, repaired."""
    from psycopg import pq

    if result.status == pq.ExecStatus.TUPLES_OK or pgconn.status != pq.ConnStatus.OK:
        return False
    state = result.error_field(pq.DiagnosticField.SQLSTATE) or b""
    return bool(state.startswith(b"23"))


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
