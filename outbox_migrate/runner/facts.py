"""The live facts a command decides from, read once: the pattern as this database needs it,
and which steps' postconditions hold. Read-only — it creates nothing, not even the ledger.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from psycopg import Connection, sql

from outbox_migrate.config import OutboxSpec, Settings
from outbox_migrate.patterns import BuildOptions, build_from_settings, build_pattern
from outbox_migrate.patterns.model import Condition, Pattern, PublicationFact, Step
from outbox_migrate.patterns.names import Names
from outbox_migrate.runner import ledger
from outbox_migrate.runner.checks import violations
from outbox_migrate.runner.decide import HasState
from outbox_migrate.runner.executors import executor_for


def identity_generation(conn: Connection[Any], spec: OutboxSpec, *, ledger_readable: bool) -> str:
    """ALWAYS or BY DEFAULT: how the old table's id is (or was) generated, and so what the
    new table's identity accepts. Only an identity `GENERATED ALWAYS` refuses an id the
    INSERT supplies; a serial, a `nextval` default or no generator at all accepts one, and so
    must the new table (BY DEFAULT). Once DROP IDENTITY ran, the ledger remembers."""
    row = conn.execute(
        "SELECT a.attidentity FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
        "WHERE a.attrelid = to_regclass(%s) AND a.attname = %s AND NOT c.relispartition",
        (sql.Identifier(spec.schema, spec.table).as_string(None), spec.id_column),
    ).fetchone()
    if row and row[0] in ("a", "d"):
        return "ALWAYS" if row[0] == "a" else "BY DEFAULT"
    recorded = ledger.recorded_identity_generation(conn, spec) if ledger_readable else None
    return recorded or "BY DEFAULT"


def migration_publications(conn: Connection[Any], spec: OutboxSpec) -> tuple[PublicationFact, ...]:
    """What the runner builds the CDC step from: the publications its migration recorded when
    it started, else (no migration yet) the live ones; none when the old table is gone."""
    from outbox_migrate.advisory.introspect import publication_facts

    recorded = ledger.recorded_publications(conn, spec)
    if recorded is not None:
        return recorded
    found = conn.execute(
        sql.SQL("SELECT to_regclass({})").format(Names(spec).reg(spec.table))
    ).fetchone()
    return publication_facts(conn, spec) if found and found[0] is not None else ()


def live_pattern(
    conn: Connection[Any],
    settings: Settings,
    name: str,
    include_optional: bool,
    *,
    ledger_readable: bool | None = None,
) -> tuple[Pattern, str, tuple[PublicationFact, ...]]:
    """The pattern as this database needs it, with the identity kind and publications it
    was built from (recorded when the migration starts)."""
    from outbox_migrate.patterns import marker_catalog

    readable = ledger.ledger_exists(conn) if ledger_readable is None else ledger_readable
    if readable and not include_optional:
        # Optional steps the ledger recorded (the original name) describe the catalog now.
        include_optional = optional_recorded(conn, settings.spec, name)
    generation = identity_generation(conn, settings.spec, ledger_readable=readable)
    publications = migration_publications(conn, settings.spec)  # recorded, else live
    spec = marker_catalog.resolve(conn, settings.spec)  # a flag marker's values (its DEFAULT)
    pattern = build_from_settings(
        name, replace(settings, spec=spec), include_optional=include_optional,
        identity_generation=generation, publications=publications,
    )  # fmt: skip
    return pattern, generation, publications


class LiveFacts:
    """One command's view of the database: the live pattern, and proofs on demand.

    It is the `ProofHost` the executors prove a step with; it never writes."""

    def __init__(self, conn: Connection[Any], settings: Settings, name: str, optional: bool):
        self.conn = conn
        self.spec = settings.spec
        self.pattern, self.identity_generation, self.publications = live_pattern(
            conn, settings, name, optional
        )

    def violations(self, conditions: Iterable[Condition]) -> list[str]:
        return violations(self.conn, conditions)

    def holds(self, step: Step) -> bool:
        """The step's effect is in place (its executor's proof)."""
        return executor_for(step).proven(self, step)

    def holding(self, steps: Iterable[Step], rows: Mapping[str, HasState]) -> dict[str, bool]:
        """Whose postcondition holds, for the steps the ledger does not record as done (the
        ledger's done needs no catalog query)."""
        found: dict[str, bool] = {}
        for step in steps:
            row = rows.get(step.id)
            if step.postcondition and (row is None or row.state != "done"):
                found[step.id] = self.holds(step)
        return found


def optional_recorded(conn: Connection[Any], spec: OutboxSpec, pattern: str) -> bool:
    """True when the table's latest live migration with `pattern` has an optional step that is
    done or running: then every command builds the pattern with them, asked or not, since
    they change the names every later check and inverse refers to (docs/runner.md)."""
    if not ledger.ledger_exists(conn):
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
