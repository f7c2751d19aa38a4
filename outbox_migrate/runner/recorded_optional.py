"""Whether a migration's ledger already holds optional steps: then every command builds the
pattern with them, asked or not.

Optional steps (the original-name phases above all) change the names every later check and
inverse refers to. A `status`, `verify` or `rollback` that left them out would read the
catalog with the old names and report a healthy renamed outbox as broken, or undo earlier
steps under names that now belong to other relations. Read-only; never writes.
"""

from __future__ import annotations

from typing import Any

from psycopg import Connection

from outbox_migrate.config import OutboxSpec


def optional_recorded(conn: Connection[Any], spec: OutboxSpec, pattern: str) -> bool:
    """True when the table's latest live migration with `pattern` has an optional step that is
    done or running (the step ids of optional phases and kinds, as the ledger recorded them)."""
    from outbox_migrate.patterns import BuildOptions, build_pattern
    from outbox_migrate.runner.admission import ledger_exists

    if not ledger_exists(conn):
        return False
    optional = [
        step.id
        for step in build_pattern(pattern, spec, BuildOptions(include_optional=True)).steps()
        if step.optional
    ]
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM outbox_migrate.step s "
        "JOIN outbox_migrate.migration m ON m.id = s.migration_id "
        "WHERE m.table_schema = %s AND m.table_name = %s AND m.pattern = %s "
        "AND m.state <> 'abandoned' AND s.state IN ('done', 'running') "
        "AND s.step_id = ANY(%s))",
        (spec.schema, spec.table, pattern.lower(), optional),
    ).fetchone()
    return bool(row and row[0])
