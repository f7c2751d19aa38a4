"""Retention as a partition drop: a published partition sub-partitioned by publication time,
its sub-partitions created ahead and dropped when expired, never blocking the publisher.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

import psycopg
from psycopg import sql

from outbox_migrate.backoff import backoff_s
from outbox_migrate.db import lock_timeout
from outbox_migrate.jobs import common
from outbox_migrate.jobs.common import Relation

Interval = Literal["day", "week", "month"]
LOCK_TIMEOUT_MS = 200
"""lock_timeout of each ATTACH/DETACH attempt: short, so nobody waits behind us for long."""
LOCK_ATTEMPTS = 10
"""Attempts per ATTACH/DETACH before giving up until the next pass."""
RETRY_BASE_S = 0.05
"""First back-off between attempts (doubled each time, with jitter)."""

_SUFFIX_FORMAT: dict[str, str] = {"day": "%Y%m%d", "week": "%Y%m%d", "month": "%Y%m"}


@dataclass(frozen=True)
class SubPartition:
    name: str
    low: datetime | None
    """Inclusive lower bound; None for MINVALUE or the DEFAULT sub-partition."""
    high: datetime | None
    """Exclusive upper bound; None for MAXVALUE or the DEFAULT sub-partition."""
    is_default: bool = False


@dataclass
class TimePartitionResult:
    table: str
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    """Sub-partitions whose ATTACH/DETACH could not get its lock this pass."""


def range_key(conn: psycopg.Connection[Any], table: Relation) -> str | None:
    """The column `table` is RANGE-partitioned on, or None when it is not (one column only)."""
    row = conn.execute(
        "SELECT pt.partstrat, pt.partnatts, a.attname FROM pg_partitioned_table pt"
        " JOIN pg_class c ON c.oid = pt.partrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
        " LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = pt.partattrs[0]"
        " WHERE n.nspname = %s AND c.relname = %s",
        (table.schema, table.name),
    ).fetchone()
    if row is None or row[0] != "r" or int(row[1]) != 1 or row[2] is None:
        return None
    return str(row[2])


def sub_partitions(conn: psycopg.Connection[Any], table: Relation) -> list[SubPartition]:
    """Direct sub-partitions with their bounds, read back as timestamptz by the server."""
    rows = conn.execute(
        "SELECT c.relname, c.oid = pt.partdefid,"
        " (regexp_match(pg_get_expr(c.relpartbound, c.oid), $r$FROM \\('([^']*)'\\)$r$))[1]"
        "   ::timestamptz,"
        " (regexp_match(pg_get_expr(c.relpartbound, c.oid), $r$TO \\('([^']*)'\\)$r$))[1]"
        "   ::timestamptz"
        " FROM pg_class p JOIN pg_namespace n ON n.oid = p.relnamespace"
        " JOIN pg_partitioned_table pt ON pt.partrelid = p.oid"
        " JOIN pg_inherits i ON i.inhparent = p.oid JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE n.nspname = %s AND p.relname = %s ORDER BY 3 NULLS FIRST",
        (table.schema, table.name),
    ).fetchall()
    return [SubPartition(str(r[0]), r[2], r[3], bool(r[1])) for r in rows]


def _with_lock_retries(conn: psycopg.Connection[Any], statement: sql.Composed) -> bool:
    """Run `statement` (autocommit) under a short lock_timeout, retrying with jittered
    back-off; False when the lock never came within the attempts."""
    for attempt in range(LOCK_ATTEMPTS):
        try:
            with lock_timeout(conn, LOCK_TIMEOUT_MS):
                conn.execute(statement)
            return True
        except psycopg.errors.LockNotAvailable:
            time.sleep(backoff_s(attempt, base_s=RETRY_BASE_S))
    return False


def _periods(
    conn: psycopg.Connection[Any], interval: Interval, ahead: int
) -> list[tuple[datetime, datetime]]:
    """[start, end) of the current period and the `ahead` following ones, in UTC."""
    rows = conn.execute(
        "SELECT s, s + make_interval(months => %(m)s, days => %(d)s) FROM ("
        " SELECT date_trunc(%(unit)s, now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"
        "   + make_interval(months => %(m)s * k, days => %(d)s * k) AS s"
        " FROM generate_series(0, %(ahead)s) k) x ORDER BY s",
        {
            "unit": interval,
            "m": 1 if interval == "month" else 0,
            "d": {"day": 1, "week": 7, "month": 0}[interval],
            "ahead": ahead,
        },
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


def ensure_ahead(
    conn: psycopg.Connection[Any],
    table: Relation,
    column: str,
    *,
    interval: Interval = "month",
    ahead: int = 2,
    result: TimePartitionResult,
) -> None:
    """Create the sub-partitions of the current and the next `ahead` periods if missing."""
    existing = [p for p in sub_partitions(conn, table) if not p.is_default]
    for start, end in _periods(conn, interval, ahead):
        if any((p.low is None or p.low < end) and (p.high is None or p.high > start)
               for p in existing):  # fmt: skip
            continue
        name = common.fit_identifier(table.name, "_" + start.strftime(_SUFFIX_FORMAT[interval]))
        sub = Relation(table.schema, name)
        check = sql.Identifier(common.fit_identifier(name, "_bounds"))
        bounds = {"lo": sql.Literal(start), "hi": sql.Literal(end), "col": sql.Identifier(column)}
        # Built standalone, then ATTACHed: ATTACH takes SHARE UPDATE EXCLUSIVE on the parent,
        # which the publisher does not conflict with (PARTITION OF takes ACCESS EXCLUSIVE).
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} (LIKE {} INCLUDING DEFAULTS)").format(
                sub.ident, table.ident
            )
        )
        # The CHECK proves the (empty) table fits, so ATTACH skips its validation scan.
        conn.execute(
            sql.SQL(
                "ALTER TABLE {t} ADD CONSTRAINT {c} CHECK ({col} IS NOT NULL AND {col} >= {lo}"
                " AND {col} < {hi})"
            ).format(t=sub.ident, c=check, **bounds)
        )
        attach = sql.SQL("ALTER TABLE {p} ATTACH PARTITION {t} FOR VALUES FROM ({lo}) TO ({hi})")
        if _with_lock_retries(conn, attach.format(p=table.ident, t=sub.ident, **bounds)):
            conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(sub.ident, check))
            result.created.append(str(sub))
        else:
            conn.execute(sql.SQL("DROP TABLE {}").format(sub.ident))
            result.busy.append(str(sub))


def drop_expired(
    conn: psycopg.Connection[Any],
    table: Relation,
    older_than: timedelta,
    *,
    result: TimePartitionResult,
) -> None:
    """Detach and drop every sub-partition whose whole range is older than the cutoff."""
    row = conn.execute(
        "SELECT now() - make_interval(secs => %s)", (older_than.total_seconds(),)
    ).fetchone()
    assert row is not None
    cutoff: datetime = row[0]
    parts = sub_partitions(conn, table)
    has_default = any(p.is_default for p in parts)
    for part in parts:
        if part.is_default or part.high is None or part.high > cutoff:
            continue
        sub = Relation(table.schema, part.name)
        if has_default:
            # CONCURRENTLY is not allowed next to a DEFAULT sub-partition: a plain DETACH
            # (ACCESS EXCLUSIVE on the parent, for a catalog change) under a short timeout.
            detached = _with_lock_retries(
                conn,
                sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(table.ident, sub.ident),
            )
        else:
            detached = _detach_concurrently(conn, table, sub)
        if not detached:
            result.busy.append(str(sub))
            continue
        conn.execute(sql.SQL("DROP TABLE {}").format(sub.ident))
        result.dropped.append(str(sub))


def _detach_concurrently(conn: psycopg.Connection[Any], table: Relation, sub: Relation) -> bool:
    try:
        return _with_lock_retries(
            conn,
            sql.SQL("ALTER TABLE {} DETACH PARTITION {} CONCURRENTLY").format(
                table.ident, sub.ident
            ),
        )
    except psycopg.errors.ObjectNotInPrerequisiteState:
        # An earlier DETACH CONCURRENTLY was interrupted half-way: finish it.
        return _with_lock_retries(
            conn,
            sql.SQL("ALTER TABLE {} DETACH PARTITION {} FINALIZE").format(table.ident, sub.ident),
        )
