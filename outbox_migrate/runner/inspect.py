"""Read-only inspection for `status` and `verify`: what the ledger records, and whether the
current phase's invariants hold — with nothing but SELECT and CONNECT.

Unlike the `Runner`, nothing here creates or upgrades the ledger schema, takes the runner's
advisory lock or writes a row: the session is read-only (`default_transaction_read_only`,
which any role may set), a missing
ledger schema simply means "no migration recorded", and a role without rights on it gets one
line naming the grant. So an auditor's or a dashboard's role can watch a migration, and a CI
gate cannot pass on a table that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.config import OutboxSpec, Settings
from outbox_migrate.db import connect
from outbox_migrate.errors import NothingRecorded, SchemaError, UsageError
from outbox_migrate.patterns import BuildOptions, build_pattern
from outbox_migrate.patterns.model import Pattern, PublicationFact
from outbox_migrate.runner import ledger
from outbox_migrate.runner.decide import completed_phase, phase_index
from outbox_migrate.runner.errors import OutOfOrder, VerifyFailed


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
    """After the rename to the original name, the migration's recorded configuration when the
    given names are the outbox's new ones (runner/renamed_lookup.py)."""
    from outbox_migrate.runner.renamed_lookup import recorded_settings

    return recorded_settings(conn, settings) if _ledger_readable(conn) else settings


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


def require_table(conn: psycopg.Connection[Any], settings: Settings) -> None:
    """Inspection of a table that is not there must fail, not report an empty success."""
    spec = settings.spec
    found = conn.execute(
        "SELECT to_regclass(%s)", (sql.Identifier(spec.schema, spec.table).as_string(None),)
    ).fetchone()
    if found is None or found[0] is None:
        raise SchemaError(
            f"table {table_label(settings)} does not exist in database {conn.info.dbname!r}; "
            "check --schema/--table (outbox-migrate config)"
        )


def recorded(conn: psycopg.Connection[Any], settings: Settings, pattern: str | None) -> Recorded:
    """The migration to show: the given pattern's latest, else the table's active one, else
    its latest completed one."""
    if not _ledger_readable(conn):
        return Recorded(None, {})
    spec = settings.spec
    active = ledger.active_for_table(conn, spec)
    if pattern is None:
        migration = active or _latest_any(conn, settings)
        other = None
    else:
        migration = ledger.latest(conn, spec, pattern.lower())
        other = active if active is not None and active.pattern != pattern.lower() else None
    if migration is None:
        return Recorded(None, {}, other)
    rows = {row.step_id: row for row in ledger.steps(conn, migration.id)}
    return Recorded(migration, rows, other)


def _latest_any(conn: psycopg.Connection[Any], settings: Settings) -> ledger.MigrationRow | None:
    row = conn.execute(
        "SELECT pattern FROM outbox_migrate.migration WHERE table_schema = %s AND "
        "table_name = %s AND state <> 'abandoned' ORDER BY id DESC LIMIT 1",
        (settings.spec.schema, settings.spec.table),
    ).fetchone()
    return ledger.latest(conn, settings.spec, str(row[0])) if row else None


def active_pattern(dsn: str, settings: Settings) -> str | None:
    """The pattern of the table's active (else latest) migration, for commands whose
    `--pattern` defaults to it."""
    with open_read_only(dsn) as conn:
        found = recorded(conn, settings, None).migration
    return found.pattern if found else None


def _pattern(
    conn: psycopg.Connection[Any], settings: Settings, name: str, include_optional: bool
) -> Pattern:
    """The pattern as the runner builds it, including the identity kind it recorded (and the
    optional steps it recorded: after the rename they describe the catalog)."""
    from outbox_migrate.runner.recorded_optional import optional_recorded

    spec = settings.spec
    if not include_optional and _ledger_readable(conn):
        include_optional = optional_recorded(conn, spec, name)
    live = conn.execute(
        "SELECT a.attidentity FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
        "WHERE a.attrelid = to_regclass(%s) AND a.attname = %s AND NOT c.relispartition",
        (sql.Identifier(spec.schema, spec.table).as_string(None), spec.id_column),
    ).fetchone()
    if live and live[0] in ("a", "d"):
        generation = "ALWAYS" if live[0] == "a" else "BY DEFAULT"
    elif _ledger_readable(conn):
        generation = ledger.recorded_identity_generation(conn, spec) or "ALWAYS"
    else:
        generation = "ALWAYS"
    return build_pattern(
        name,
        spec,
        BuildOptions(
            sample_window_s=settings.gate_window_s,
            old_app_name=settings.old_app_name,
            include_optional=include_optional,
            identity_generation=generation,
            publications=_publications(conn, spec),
        ),
    )


def _publications(conn: psycopg.Connection[Any], spec: OutboxSpec) -> tuple[PublicationFact, ...]:
    """The old table's publications (none when it is gone): the conditional CDC step."""
    from outbox_migrate.introspect import migration_publications

    return migration_publications(conn, spec)


def _phase(pattern: Pattern, migration: ledger.MigrationRow, rows: dict[str, Any]) -> str:
    """The phase the ledger records as reached, never beyond what its steps prove."""
    proven = phase_index(pattern, completed_phase(pattern, rows))
    try:
        recorded_index = phase_index(pattern, migration.current_phase)
    except OutOfOrder:
        recorded_index = proven
    return pattern.phases[min(proven, recorded_index)].name


def status(
    dsn: str, settings: Settings, pattern: str | None = None, *, include_optional: bool = False
) -> dict[str, Any]:
    """Where the table's migration stands; `recorded` is False when the ledger has none."""
    with open_read_only(dsn) as conn:
        settings = _by_either_name(conn, settings)
        found = recorded(conn, settings, pattern)
        if found.migration is None:
            require_table(conn, settings)
            document: dict[str, Any] = {
                "table": table_label(settings),
                "pattern": pattern.lower() if pattern else None,
                "recorded": False,
                "state": "not started",
                "phase": None,
                "next_phase": None,
                "steps": [],
            }
            if found.other is not None:
                document["active_pattern"] = found.other.pattern
            return document
        migration = found.migration
        built = _pattern(conn, settings, migration.pattern, include_optional)
    reached = _phase(built, migration, found.steps)
    index = phase_index(built, reached)
    following = built.phases[index + 1].name if index + 1 < len(built.phases) else None
    return {
        "table": table_label(settings),
        "pattern": built.name,
        "recorded": True,
        "state": migration.state,
        "phase": reached,
        "next_phase": following,
        "steps": [
            {
                "id": step.id,
                "phase": step.phase,
                "summary": step.summary,
                **(
                    found.steps[step.id].to_json()
                    if step.id in found.steps
                    else {"state": "pending"}
                ),
            }
            for step in built.steps()
        ],
    }


def not_recorded_message(settings: Settings, pattern: str | None, other: str | None) -> str:
    what = f"no {pattern.upper()} migration" if pattern else "no migration"
    also = f" (a {other.upper()} migration is active)" if other else ""
    return f"{what} recorded for {table_label(settings)}{also}"


def verify(
    dsn: str, settings: Settings, pattern: str | None = None, *, include_optional: bool = False
) -> str:
    """Check the invariants of the recorded phase; return the phase, or raise `VerifyFailed`
    (a violation), `NothingRecorded` (no migration to verify) or `SchemaError` (no table)."""
    with open_read_only(dsn) as conn:
        settings = _by_either_name(conn, settings)
        require_table(conn, settings)
        found = recorded(conn, settings, pattern)
        if found.migration is None:
            other = found.other.pattern if found.other else None
            raise NothingRecorded(
                not_recorded_message(settings, pattern, other)
                + "; nothing to verify — start it with `outbox-migrate run`"
            )
        built = _pattern(conn, settings, found.migration.pattern, include_optional)
        phase = _phase(built, found.migration, found.steps)
        violations: list[str] = []
        done = frozenset(i for i, row in found.steps.items() if row.state == "done")
        for _, condition in built.invariants(phase, done):
            violations.extend(str(r[0]) for r in conn.execute(condition.query).fetchall())
    if violations:
        raise VerifyFailed(phase, violations)
    return phase
