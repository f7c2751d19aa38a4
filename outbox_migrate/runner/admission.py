"""The one admission check: what `plan` reports as a blocker stops `run`, `next`, the Alembic
operations and the jobs too, before anything is written — the ledger included.
"""

from __future__ import annotations

from typing import Any

from psycopg import Connection, sql

from outbox_migrate.advisory.introspect import introspect, raise_for_blockers
from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import SchemaError, UsageError
from outbox_migrate.runner.ledger import another_active, ledger_exists


def require_table(conn: Connection[Any], spec: OutboxSpec) -> None:
    """A command on a table that is not there must fail, not report an empty success."""
    name = sql.Identifier(spec.schema, spec.table).as_string(None)
    found = conn.execute("SELECT to_regclass(%s)", (name,)).fetchone()
    if found is None or found[0] is None:
        raise SchemaError(
            f"table {spec.schema}.{spec.table} does not exist in database "
            f"{conn.info.dbname!r}; check --schema/--table (outbox-migrate config)"
        )


def admit(conn: Connection[Any], spec: OutboxSpec, pattern: str) -> None:
    """Raise (exit 2) when this pattern may not start on the table; return quietly when it
    may, or when its migration is already under way."""
    table = f"{spec.schema}.{spec.table}"
    ever_recorded = False
    if ledger_exists(conn):
        rows = conn.execute(
            "SELECT id, pattern, state, current_phase FROM outbox_migrate.migration "
            "WHERE table_schema = %s AND table_name = %s ORDER BY id",
            (spec.schema, spec.table),
        ).fetchall()
        ever_recorded = bool(rows)
        for migration_id, other, state, phase in rows:
            if state == "abandoned":
                continue
            if other == pattern:
                # Admitted when it started: its own later states (the old table a partition,
                # say) are no blockers.
                return
            if state == "active":
                raise another_active(spec, str(other), phase)
            raise UsageError(
                f"{table} was already migrated by {str(other).upper()} (migration "
                f"#{migration_id}, completed); nothing to migrate — its objects are left "
                "untouched"
            )
    if not ever_recorded and _partition_of_our_parent(conn, spec):
        # The old table is already a partition of the partitioned table this migration is
        # named for, and no ledger ever recorded a migration of it: the pattern's own steps
        # did that (applied as offline SQL, then resumed online). The blockers describe a
        # flat table (on PostgreSQL <= 16 an attached table also shows no identity), so they
        # do not apply; every step still proves its state, and objects found this way are
        # adopted as `found`, never dropped by a rollback. After a `reset --force` the same
        # layout is another migration's leftovers, which a run would adopt and stick half-way.
        return
    raise_for_blockers(introspect(conn, spec, pattern))


def _partition_of_our_parent(conn: Connection[Any], spec: OutboxSpec) -> bool:
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass(%s) "
        "AND inhparent = to_regclass(%s))",
        (
            sql.Identifier(spec.schema, spec.table).as_string(None),
            sql.Identifier(spec.schema, spec.partitioned_table).as_string(None),
        ),
    ).fetchone()
    return bool(row and row[0])
