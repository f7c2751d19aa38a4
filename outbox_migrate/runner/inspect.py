"""Read-only inspection for `status` and `verify`: what the ledger records and whether the
current phase's invariants hold. It must not create the ledger, take the runner's lock or write.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import psycopg

from outbox_migrate.config import OutboxSpec, Settings
from outbox_migrate.db import connect
from outbox_migrate.errors import NothingDone, UsageError, VerifyFailed
from outbox_migrate.patterns.model import Pattern
from outbox_migrate.runner import checks, ledger
from outbox_migrate.runner.admission import require_table
from outbox_migrate.runner.decide import phase_index, reached_phase
from outbox_migrate.runner.facts import live_pattern

_TUPLES = ("metadata_columns", "accept_lost_unique")


# -- the status document (`outbox-migrate status`, `Runner.status()`): pure, no I/O -------


def recorded_document(
    table: str, pattern: Pattern, migration: ledger.MigrationRow, rows: Mapping[str, ledger.StepRow]
) -> dict[str, Any]:
    """A migration the ledger records: its state, the phase its steps prove, every step."""
    reached = reached_phase(pattern, migration.current_phase, rows)
    index = phase_index(pattern, reached)
    following = pattern.phases[index + 1].name if index + 1 < len(pattern.phases) else None
    return {
        "table": table,
        "pattern": pattern.name,
        "recorded": True,
        "state": migration.state,
        "phase": reached,
        "next_phase": following,
        "steps": [
            {
                "id": step.id,
                "phase": step.phase,
                "summary": step.summary,
                **(rows[step.id].to_json() if step.id in rows else {"state": "pending"}),
            }
            for step in pattern.steps()
        ],
    }


def unrecorded_document(
    table: str, pattern: str | None, *, first_phase: str | None, active_pattern: str | None
) -> dict[str, Any]:
    """No migration of this pattern (or none at all) is recorded for the table."""
    document: dict[str, Any] = {
        "table": table,
        "pattern": pattern,
        "recorded": False,
        "state": "not started",
        "phase": first_phase,
        "next_phase": None,
        "steps": [],
    }
    if active_pattern is not None:
        document["active_pattern"] = active_pattern
    return document


@dataclass(frozen=True)
class Recorded:
    """The ledger's migration of a table (None when nothing is recorded) and its steps."""

    migration: ledger.MigrationRow | None
    steps: dict[str, ledger.StepRow]
    other: ledger.MigrationRow | None = None
    """The active migration of another pattern, when `pattern` was given and differs."""


def open_read_only(dsn: str) -> psycopg.Connection[Any]:
    conn = connect(dsn)
    conn.execute("SET default_transaction_read_only = on")
    return conn


def table_label(settings: Settings) -> str:
    return f"{settings.spec.schema}.{settings.spec.table}"


def _by_either_name(conn: psycopg.Connection[Any], settings: Settings) -> Settings:
    """`settings` with the recorded spec of a renamed migration the given names point at;
    `settings` unchanged when a migration is recorded under `table` itself, or none matches
    (or there is no ledger).

    The ledger keys a migration by the flat table's name. After `take-original-name` an
    operator may name the outbox as it now is: the view under the partitioned table's former
    name (`--table outbox_new`), or the partitioned table under the original name
    (`--partitioned-table outbox`, as its relays do)."""
    if not _ledger_readable(conn):
        return settings
    spec = settings.spec
    row = conn.execute(
        "SELECT (SELECT m.spec::text FROM outbox_migrate.migration m "
        "        WHERE m.table_schema = %(schema)s AND m.state <> 'abandoned' "
        "          AND (m.spec->>'partitioned_table' = %(table)s OR m.table_name = %(parent)s) "
        "          AND EXISTS (SELECT 1 FROM outbox_migrate.step s WHERE s.migration_id = m.id "
        "                      AND s.kind = 'take-original-name' AND s.state = 'done') "
        "        ORDER BY m.id DESC LIMIT 1) "
        "WHERE NOT EXISTS (SELECT 1 FROM outbox_migrate.migration WHERE table_schema = "
        "%(schema)s AND table_name = %(table)s AND state <> 'abandoned')",
        {"schema": spec.schema, "table": spec.table, "parent": spec.partitioned_table},
    ).fetchone()
    if row is None or row[0] is None:
        return settings
    stored = json.loads(str(row[0]))
    known = {f.name for f in fields(OutboxSpec)}
    values: dict[str, Any] = {
        k: (tuple(v) if k in _TUPLES else v) for k, v in stored.items() if k in known
    }
    return replace(settings, spec=OutboxSpec(**values))


def _ledger_readable(conn: psycopg.Connection[Any]) -> bool:
    """False when the ledger schema does not exist yet; raise when it exists but this role
    may not read it."""
    row = conn.execute(
        "SELECT n.oid IS NOT NULL, "
        "       coalesce(has_schema_privilege(n.oid, 'USAGE'), false), "
        "       EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = n.oid "
        "               AND c.relname = 'migration') "
        "FROM (SELECT 1) one LEFT JOIN pg_namespace n ON n.nspname = %s",
        (ledger.SCHEMA,),
    ).fetchone()
    exists, usable, table = row if row else (False, False, False)
    if not exists or (usable and not table):
        return False
    if not usable:
        raise UsageError(
            f"role {conn.info.user!r} cannot read the migration ledger: GRANT USAGE ON SCHEMA "
            f"{ledger.SCHEMA} and SELECT ON ALL TABLES IN SCHEMA {ledger.SCHEMA} to it"
        )
    return True


def recorded(conn: psycopg.Connection[Any], settings: Settings, pattern: str | None) -> Recorded:
    """The migration to show: the given pattern's latest, else the table's active one, else
    its latest completed one."""
    if not _ledger_readable(conn):
        return Recorded(None, {})
    spec = settings.spec
    active = ledger.active_for_table(conn, spec)
    if pattern is None:
        migration = active or ledger.latest(conn, spec, None)
        other = None
    else:
        migration = ledger.latest(conn, spec, pattern.lower())
        other = active if active is not None and active.pattern != pattern.lower() else None
    if migration is None:
        return Recorded(None, {}, other)
    return Recorded(migration, ledger.step_rows(conn, migration.id), other)


def active_pattern(dsn: str, settings: Settings) -> str | None:
    """The pattern of the table's active (else latest) migration, for commands whose
    `--pattern` defaults to it. With nothing recorded, a table that is not there is bad input
    (exit 2), as for `status` and `run`, not "nothing to do"; a recorded migration is found
    whatever became of its table (`reset` must still abandon it)."""
    with open_read_only(dsn) as conn:
        found = recorded(conn, settings, None).migration
        if found is None:
            require_table(conn, settings.spec)
    return found.pattern if found else None


def _pattern(
    conn: psycopg.Connection[Any], settings: Settings, name: str, include_optional: bool
) -> Pattern:
    """The pattern as the runner builds it, including the identity kind it recorded."""
    readable = _ledger_readable(conn)
    return live_pattern(conn, settings, name, include_optional, ledger_readable=readable)[0]


def status(
    dsn: str, settings: Settings, pattern: str | None = None, *, include_optional: bool = False
) -> dict[str, Any]:
    """Where the table's migration stands; `recorded` is False when the ledger has none."""
    with open_read_only(dsn) as conn:
        settings = _by_either_name(conn, settings)
        found = recorded(conn, settings, pattern)
        if found.migration is None:
            require_table(conn, settings.spec)
            return unrecorded_document(
                table_label(settings), pattern.lower() if pattern else None, first_phase=None,
                active_pattern=found.other.pattern if found.other is not None else None,
            )  # fmt: skip
        migration = found.migration
        built = _pattern(conn, settings, migration.pattern, include_optional)
    return recorded_document(table_label(settings), built, migration, found.steps)


def not_recorded_message(settings: Settings, pattern: str | None, other: str | None) -> str:
    what = f"no {pattern.upper()} migration" if pattern else "no migration"
    also = f" (a {other.upper()} migration is active)" if other else ""
    return f"{what} recorded for {table_label(settings)}{also}"


def verify(
    dsn: str, settings: Settings, pattern: str | None = None, *, include_optional: bool = False
) -> str:
    """Check the invariants of the recorded phase; return the phase, or raise `VerifyFailed`
    (a violation), `NothingDone` (no migration to verify) or `SchemaError` (no table)."""
    with open_read_only(dsn) as conn:
        settings = _by_either_name(conn, settings)
        require_table(conn, settings.spec)
        found = recorded(conn, settings, pattern)
        if found.migration is None:
            other = found.other.pattern if found.other else None
            raise NothingDone(
                not_recorded_message(settings, pattern, other)
                + "; nothing to verify — start it with `outbox-migrate run`"
            )
        built = _pattern(conn, settings, found.migration.pattern, include_optional)
        phase = reached_phase(built, found.migration.current_phase, found.steps)
        done = frozenset(i for i, row in found.steps.items() if row.state == "done")
        violations = checks.violations(conn, built.verified(phase, done))
    if violations:
        raise VerifyFailed(phase, violations)
    return phase
