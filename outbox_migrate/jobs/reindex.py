"""REINDEX INDEX CONCURRENTLY for the outbox's hot index, done so it cannot hurt the writers:
refused under an old transaction, leftovers dropped, one maintainer per table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.db import lock_timeout, try_session_lock
from outbox_migrate.errors import ReindexFailed, ReindexRefused
from outbox_migrate.jobs.common import Relation

DEFAULT_MAX_XACT_AGE_S = 60.0
"""A transaction older than this makes us refuse to start a REINDEX CONCURRENTLY."""
DEFAULT_REINDEX_LOCK_TIMEOUT_MS = 10_000
"""lock_timeout for REINDEX CONCURRENTLY's own waits on older transactions. Its table lock
(SHARE UPDATE EXCLUSIVE) blocks no DML, so a waiting REINDEX does not stall writers."""
HIDDEN_SAMPLE_S = 1.0
"""How long a transaction whose start is hidden from us must stay open to be counted: its age
is unknown, so a transaction seen at both ends of this pause is taken as old (the guard does
not pass on what it cannot see)."""
DROP_LEFTOVER_LOCK_TIMEOUT_MS = 2_000
ADVISORY_NAMESPACE = "outbox-migrate:reindex:"


@dataclass(frozen=True)
class OldTransaction:
    """A transaction that would make REINDEX CONCURRENTLY wait."""

    pid: int | None
    age_s: float
    state: str
    application_name: str
    prepared_gid: str | None = None
    at_least: bool = False
    """The transaction's start is hidden from us: `age_s` is how long we saw it open."""

    def describe(self) -> str:
        if self.prepared_gid is not None:
            return f"prepared transaction {self.prepared_gid!r} ({self.age_s:.0f}s old)"
        app = f" ({self.application_name})" if self.application_name else ""
        old = "at least " if self.at_least else ""
        return f"pid {self.pid}{app}, {self.state}, transaction {old}{self.age_s:.0f}s old"


def old_transactions(conn: psycopg.Connection[Any], max_age_s: float) -> list[OldTransaction]:
    """Transactions in this database older than `max_age_s`, ours excluded.

    Any open transaction counts, even a read-only one without a snapshot between statements:
    the locks it keeps on the table make REINDEX CONCURRENTLY's last phase wait for it.
    """
    rows = conn.execute(
        "SELECT pid, extract(epoch FROM now() - xact_start)::float8, coalesce(state, ''),"
        " coalesce(application_name, '') FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND backend_type = 'client backend' AND xact_start IS NOT NULL"
        " AND xact_start < now() - make_interval(secs => %s)"
        " ORDER BY xact_start",
        (max_age_s,),
    ).fetchall()
    blockers = [OldTransaction(int(r[0]), float(r[1]), str(r[2]), str(r[3])) for r in rows]
    prepared = conn.execute(
        "SELECT gid, extract(epoch FROM now() - prepared)::float8 FROM pg_prepared_xacts"
        " WHERE database = current_database() AND prepared < now() - make_interval(secs => %s)",
        (max_age_s,),
    ).fetchall()
    blockers += [OldTransaction(None, float(r[1]), "prepared", "", str(r[0])) for r in prepared]
    return blockers + hidden_open_transactions(conn)


def hidden_open_transactions(conn: psycopg.Connection[Any]) -> list[OldTransaction]:
    """Client transactions of other roles whose start PostgreSQL hides from us (without
    pg_read_all_stats) and that stay open across `HIDDEN_SAMPLE_S`: the same virtual
    transaction id in pg_locks (visible to every role) at both looks. Sessions without a role
    (autovacuum) are not clients."""
    from outbox_migrate.errors import grant_to_see

    def look() -> dict[tuple[int, str], tuple[str, str]]:
        rows = conn.execute(
            "SELECT l.pid, l.virtualxid, coalesce(a.application_name, ''), current_user "
            "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'virtualxid' AND l.granted AND l.pid <> pg_backend_pid() "
            "AND a.datname = current_database() AND a.backend_type IS NULL "
            "AND a.usesysid IS NOT NULL"
        ).fetchall()
        return {(int(r[0]), str(r[1])): (str(r[2]), str(r[3])) for r in rows}

    first = look()
    if not first:
        return []
    time.sleep(HIDDEN_SAMPLE_S)
    still = look()
    found: list[OldTransaction] = []
    for key in sorted(first.keys() & still.keys()):
        app, role = still[key]
        state = f"its start hidden from {role}: {grant_to_see(role)}"
        found.append(OldTransaction(key[0], HIDDEN_SAMPLE_S, state, app, at_least=True))
    return found


def leftover_indexes(conn: psycopg.Connection[Any], table: Relation) -> list[str]:
    """Invalid `_ccnew`/`_ccold` indexes a failed REINDEX CONCURRENTLY left on `table`."""
    rows = conn.execute(
        "SELECT ic.relname FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid"
        " JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s AND NOT i.indisvalid"
        " AND ic.relname ~ '_cc(new|old)[0-9]*$' ORDER BY ic.relname",
        (table.schema, table.name),
    ).fetchall()
    return [str(r[0]) for r in rows]


def drop_leftovers(conn: psycopg.Connection[Any], table: Relation) -> tuple[list[str], list[str]]:
    """DROP INDEX CONCURRENTLY each invalid leftover; returns (dropped, still there).

    Only invalid indexes whose names carry REINDEX's suffixes are touched, never a valid one.
    A drop waits for the same transactions the REINDEX waited for, so it can time out too;
    what is left is dropped by the next pass, before it starts anything new.
    """
    dropped, remaining = [], []
    for name in leftover_indexes(conn, table):
        drop = sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(
            sql.Identifier(table.schema, name)
        )
        try:
            with lock_timeout(conn, DROP_LEFTOVER_LOCK_TIMEOUT_MS):
                conn.execute(drop)
            dropped.append(name)
        except psycopg.Error:
            remaining.append(name)
    return dropped, remaining


@dataclass(frozen=True)
class ReindexResult:
    index: str
    seconds: float
    leftovers_dropped: tuple[str, ...]
    window: tuple[float, float]
    """`time.monotonic()` when the REINDEX started and ended."""


def reindex_concurrently(
    conn: psycopg.Connection[Any],
    table: Relation,
    index: str,
    *,
    max_xact_age_s: float = DEFAULT_MAX_XACT_AGE_S,
    lock_timeout_ms: int = DEFAULT_REINDEX_LOCK_TIMEOUT_MS,
) -> ReindexResult:
    """Rebuild `index` (on `table`) without blocking writes, or refuse/fail cleanly.

    Raises `ReindexRefused` (nothing done) when another maintainer holds the lock or an old
    transaction would block the rebuild, `ReindexFailed` after cleaning up when it fails.
    """
    if not conn.autocommit:
        raise ReindexFailed("REINDEX CONCURRENTLY needs an autocommit connection")
    with try_session_lock(conn, f"{ADVISORY_NAMESPACE}{table}") as locked:
        if not locked:
            raise ReindexRefused(f"another outbox-migrate maintain is reindexing {table}")
        # Leftovers from an earlier failure first: an invalid index costs every insert.
        dropped, remaining = drop_leftovers(conn, table)
        if remaining:
            raise ReindexRefused(
                f"not reindexing {table.schema}.{index}: leftover invalid index(es) "
                f"{', '.join(remaining)} could not be dropped yet (a transaction holds them)"
            )
        blockers = old_transactions(conn, max_xact_age_s)
        if blockers:
            shown = "; ".join(b.describe() for b in blockers[:3])
            hidden = ", or whose age is hidden," if any(b.at_least for b in blockers) else ""
            raise ReindexRefused(
                f"not reindexing {table.schema}.{index}: {len(blockers)} transaction(s) older "
                f"than {max_xact_age_s:.0f}s{hidden} would block REINDEX CONCURRENTLY ({shown})"
            )
        started = time.monotonic()
        target = sql.Identifier(table.schema, index)
        try:
            with lock_timeout(conn, lock_timeout_ms):
                conn.execute(sql.SQL("REINDEX INDEX CONCURRENTLY {}").format(target))
        except psycopg.Error as exc:
            reason = (str(exc).strip().splitlines() or ["unknown error"])[0]
            cleaned, left = drop_leftovers(conn, table)
            note = f"; dropped leftover {', '.join(cleaned)}" if cleaned else ""
            if left:
                note += f"; leftover {', '.join(left)} will be dropped by the next pass"
            raise ReindexFailed(
                f"REINDEX INDEX CONCURRENTLY {table.schema}.{index} failed: {reason}{note}"
            ) from None
        ended = time.monotonic()
        return ReindexResult(index, ended - started, tuple(dropped), (started, ended))
