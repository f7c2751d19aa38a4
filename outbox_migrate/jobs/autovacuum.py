"""Per-partition autovacuum settings for the outbox: the spec's insert-only tuning, applied and
checked.

The published partition only ever receives inserts (the publisher's cross-partition UPDATE
lands there as an insert) and can grow without bound. With the default scale factors its
vacuum and analyze runs get rarer as it grows (20 % / 10 % of an ever larger table); the spec
instead runs both every fixed number of inserted rows, whatever the size. The unpublished
partition is small and churns, so the defaults suit it and we leave it alone.

Setting storage parameters takes SHARE UPDATE EXCLUSIVE: it does not block the application's
reads or writes, but it waits for a running (auto)vacuum, so it runs under a lock_timeout and
reports "busy" instead of queueing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.jobs.common import Relation

DEFAULT_EVERY_ROWS = 100_000
"""Vacuum and analyze the published partition every this many inserted rows (the spec's)."""
LOCK_TIMEOUT_MS = 1_000


def published_settings(every_rows: int = DEFAULT_EVERY_ROWS) -> dict[str, str]:
    """The spec's insert-only settings: fixed thresholds, no scale factor."""
    return {
        "autovacuum_vacuum_insert_scale_factor": "0",
        "autovacuum_vacuum_insert_threshold": str(every_rows),
        "autovacuum_analyze_scale_factor": "0",
        "autovacuum_analyze_threshold": str(every_rows),
    }


@dataclass(frozen=True)
class AutovacuumCheck:
    table: str
    expected: dict[str, str]
    actual: dict[str, str]
    applied: bool
    """True when this run changed the settings."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return all(_same(self.actual.get(k), v) for k, v in self.expected.items())


def _same(actual: str | None, expected: str) -> bool:
    if actual is None:
        return False
    try:
        return float(actual) == float(expected)
    except ValueError:
        return actual == expected


def current_settings(conn: psycopg.Connection[Any], table: Relation) -> dict[str, str]:
    row = conn.execute(
        "SELECT c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s",
        (table.schema, table.name),
    ).fetchone()
    options = (row[0] if row else None) or []
    return dict(str(o).split("=", 1) for o in options)


def ensure(
    conn: psycopg.Connection[Any], table: Relation, expected: dict[str, str], *, apply: bool
) -> AutovacuumCheck:
    """Check `table`'s settings; with `apply`, set the ones that differ and check again."""
    actual = current_settings(conn, table)
    check = AutovacuumCheck(str(table), expected, actual, applied=False)
    if check.ok or not apply:
        return check
    assignments = sql.SQL(", ").join(
        sql.SQL("{} = {}").format(sql.Identifier(k), sql.Literal(v)) for k, v in expected.items()
    )
    from outbox_migrate.errors import LockBudgetExceeded
    from outbox_migrate.lock_budget import LockBudget, run_with_lock_budget

    statement = sql.SQL("ALTER TABLE {} SET ({})").format(table.ident, assignments)
    try:
        # One attempt (budget 0): a vacuum holding the table is normal; the next run retries.
        run_with_lock_budget(
            conn, "autovacuum-settings", LockBudget(lock_timeout_ms=LOCK_TIMEOUT_MS, budget_s=0.0),
            lambda c: c.execute(statement), relations=(), schema=table.schema,
            watch_blockers=False,
        )  # fmt: skip
    except LockBudgetExceeded:
        busy = "table busy (a vacuum holds its lock); retried next run"
        return AutovacuumCheck(str(table), expected, actual, applied=False, error=busy)
    return AutovacuumCheck(str(table), expected, current_settings(conn, table), applied=True)
