"""The ledger's attempt log, read only: each step's latest lock attempt, for `status`. Never
creates the ledger; nothing here prints.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from psycopg import Connection

from outbox_migrate.config import OutboxSpec
from outbox_migrate.db import connect

_LATEST = """
SELECT DISTINCT ON (a.step_id) a.step_id, a.attempt, a.at, a.outcome, a.waited_ms, a.blockers
FROM outbox_migrate.attempt a
JOIN outbox_migrate.migration m ON m.id = a.migration_id
WHERE m.id = (SELECT id FROM outbox_migrate.migration
              WHERE table_schema = %s AND table_name = %s AND pattern = %s
                AND state <> 'abandoned' ORDER BY id DESC LIMIT 1)
ORDER BY a.step_id, a.at DESC, a.attempt DESC
"""


def latest_attempts(dsn: str, spec: OutboxSpec, pattern: str) -> dict[str, dict[str, Any]]:
    """Step id → its latest attempt (`attempt`, `at`, `outcome`, `waited_ms`, `blockers`) in
    the table's latest migration of `pattern`; empty when there is no ledger to read."""
    with connect(dsn) as conn:
        conn.execute("SET default_transaction_read_only = on")
        if not _readable(conn):
            return {}
        rows = conn.execute(_LATEST, (spec.schema, spec.table, pattern.lower())).fetchall()
    return {
        str(step): {"attempt": attempt, "at": at, "outcome": outcome, "waited_ms": waited,
                    "blockers": blockers or []}
        for step, attempt, at, outcome, waited, blockers in rows
    }  # fmt: skip


def _readable(conn: Connection[Any]) -> bool:
    """The ledger exists and this role may read both tables (checked in that order: a
    privilege check on a table that does not exist would raise)."""
    row = conn.execute(
        "SELECT coalesce(has_schema_privilege(n.oid, 'USAGE'), false) "
        "FROM (SELECT 1) one LEFT JOIN pg_namespace n ON n.nspname = 'outbox_migrate'"
    ).fetchone()
    if not (row and row[0]):
        return False
    row = conn.execute(
        "SELECT CASE WHEN to_regclass('outbox_migrate.attempt') IS NULL "
        "            OR to_regclass('outbox_migrate.migration') IS NULL THEN false "
        "       ELSE has_table_privilege('outbox_migrate.attempt', 'SELECT') "
        "            AND has_table_privilege('outbox_migrate.migration', 'SELECT') END"
    ).fetchone()
    return bool(row and row[0])


def newer_than_error(attempt: dict[str, Any] | None, step: dict[str, Any]) -> bool:
    """Whether `attempt` happened after the step's recorded error (or there is none) and
    did not succeed: then it, not the error, says where the step stands (a run interrupted
    while it retries records its attempts but no error)."""
    if attempt is None or attempt["outcome"] == "done":
        return False
    if not step.get("last_error"):
        return step.get("state") != "done"
    recorded = step.get("finished_at") or step.get("started_at")
    if isinstance(recorded, str):  # a document that went through JSON
        recorded = datetime.fromisoformat(recorded)
    return isinstance(recorded, datetime) and attempt["at"] > recorded
