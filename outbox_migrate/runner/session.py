"""The runner's session: its connection (own or borrowed from Alembic) and the session-level
advisory lock that admits one runner per table. It knows nothing of patterns or steps.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from outbox_migrate.db import connect
from outbox_migrate.errors import RunnerBusy, grant_to_see

RUNNER_LOCK_CLASS = 0x6F6D7275  # "omru": first key of the per-table session advisory lock


def runner_lock_key(table_label: str) -> tuple[int, int]:
    """The two keys of the advisory lock a runner of `table_label` holds for its session
    (`status --watch` looks for its holder)."""
    return RUNNER_LOCK_CLASS, zlib.crc32(table_label.encode()) & 0x7FFFFFFF


class Session:
    """One connection and whether it holds the table's runner lock."""

    def __init__(self, dsn: str, table_label: str) -> None:
        self.dsn = dsn
        self.table_label = table_label
        self._conn: psycopg.Connection[Any] | None = None
        self._locked = False
        self.borrowed = False

    def borrow(self, conn: psycopg.Connection[Any]) -> None:
        """Drive a connection someone else owns (Alembic's): never closed here."""
        self._conn = conn
        self.borrowed = True

    def open(self) -> None:
        if not self.borrowed:
            self._conn = connect(self.dsn)

    def close(self) -> None:
        if self.borrowed:
            self.release()
            self._conn = None
            return
        if self._conn is not None:
            # Unlock first: after a close the server process ends (and its locks go) only a
            # moment later, and an operator's next command must not be refused meanwhile.
            try:
                with contextlib.suppress(psycopg.Error):
                    self.release()
            finally:
                self._conn.close()  # a lock the unlock could not give back goes with it
                self._conn = None
        self._locked = False

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None:
            raise RuntimeError("Runner used outside its `with` block")
        return self._conn

    @property
    def live(self) -> bool:
        """The connection is open (an error handler may still write to it)."""
        return self._conn is not None and not self._conn.closed

    def acquire(self) -> None:
        """The session advisory lock that admits one runner per table."""
        if self._locked:
            return
        first, second = runner_lock_key(self.table_label)
        # A session lock on purpose: it dies with the session (a crashed runner never leaves it
        # behind) and is held across the many short transactions of a run.
        row = self.conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (first, second)).fetchone()
        if row and row[0]:
            self._locked = True
            return
        # client_addr and backend_start of another role's session are NULL unless we may see
        # its activity (pg_read_all_stats); its role and application_name are always shown.
        holder = self.conn.execute(
            "SELECT a.pid, coalesce(a.application_name, ''), a.usename::text, "
            "CASE WHEN a.backend_type IS NULL THEN current_user END, "
            "coalesce(host(a.client_addr), 'local socket'), a.backend_start "
            "FROM pg_locks l JOIN pg_stat_activity a "
            "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.classid = %s "
            "AND l.objid = %s AND l.objsubid = 2 AND l.granted",
            (first, second),
        ).fetchone()
        if holder is None:
            who = "a session that just ended; retry"
        elif holder[3] is not None:
            who = (
                f"pid {holder[0]} ({holder[1] or 'no application_name'}, role {holder[2]}; "
                f"where from and since when is hidden from {holder[3]}: "
                f"{grant_to_see(str(holder[3]))})"
            )
        else:
            who = (
                f"pid {holder[0]} ({holder[1] or 'no application_name'}, from {holder[4]}, "
                f"connected since {holder[5]:%Y-%m-%d %H:%M:%S})"
            )
        raise RunnerBusy(f"another runner is migrating {self.table_label}: {who}")

    def release(self) -> None:
        """Give the per-table advisory lock back without closing the session."""
        conn = self._conn
        # In a failed transaction the unlock cannot run; raising here would hide the step's
        # own error, and the end of the owner's session releases the lock anyway.
        if (
            self._locked
            and conn is not None
            and not conn.closed
            and conn.info.transaction_status is not TransactionStatus.INERROR
        ):
            first, second = runner_lock_key(self.table_label)
            conn.execute("SELECT pg_advisory_unlock(%s, %s)", (first, second))
        self._locked = False
