"""`plan --format sql` for names that need quoting: a schema, tables and columns with capitals
and spaces. Every identifier and every catalog lookup in the generated SQL and in the offline
assertions must survive them, so each pattern is applied phase by phase with psql."""

from __future__ import annotations

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from outbox_migrate_harness.testing.server import Server
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import PATTERN_NAMES, BuildOptions, build_pattern
from outbox_migrate.patterns.model import Table
from outbox_migrate.plan import split_sql_phases
from tests.e2e.test_plan_sql_with_psql import psql
from tests.golden.regenerate import run_plan
from tests.support.app import violations

SPEC = OutboxSpec(
    schema="Billing",
    table="Outbox",
    partitioned_table="Outbox New",
    unpublished_partition="Outbox Todo",
    published_partition="Outbox Done",
    id_column="Id",
    published_column="Sent At",
)
FLAGS = (
    "--schema", SPEC.schema, "--table", SPEC.table, "--partitioned-table", SPEC.partitioned_table,
    "--unpublished-partition", SPEC.unpublished_partition,
    "--published-partition", SPEC.published_partition,
    "--id-column", SPEC.id_column, "--published-column", SPEC.published_column,
    "--with-optional",
)  # fmt: skip


def publish_all(conn: psycopg.Connection, table: str) -> None:
    conn.execute(
        sql.SQL("UPDATE {} SET {} = now() WHERE {} IS NULL").format(
            sql.Identifier(SPEC.schema, table),
            sql.Identifier(SPEC.published_column),
            sql.Identifier(SPEC.published_column),
        )
    )


def count(conn: psycopg.Connection, table: str) -> int:
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(SPEC.schema, table))
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.newest_pg_only
@pytest.mark.parametrize("pattern", PATTERN_NAMES)
def test_quoted_names_through_every_phase(pattern: str, pg_server: Server, dsn: str) -> None:
    phases = split_sql_phases(run_plan(("--pattern", pattern, "--format", "sql", *FLAGS)))
    built = build_pattern(pattern, SPEC, BuildOptions(include_optional=True))
    assert list(phases) == built.phase_names()
    old, new = SPEC.table, SPEC.partitioned_table
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn, SPEC)
        insert_rows(conn, old, 50, spec=SPEC, published=True)
        insert_rows(conn, old, 5, spec=SPEC)
        written = 55
        for index, phase in enumerate(built.phases):
            if index and built.phases[index - 1].app.publishes_from in (
                Table.OLD,
                Table.OLD_THEN_NEW,
            ):
                publish_all(conn, old)
            # The deploy gates sample for gate_window_s (2 s by default); 0.1 s is plenty here.
            result = psql(
                pg_server, dsn, phases[phase.name].replace("pg_sleep(2.0)", "pg_sleep(0.1)")
            )
            assert result.returncode == 0, f"{phase.name}: {result.stderr}"
            # After the optional rename the partitioned table goes by the original name.
            parent = old if phase.app.renamed else new
            target = old if phase.app.inserts_into is Table.OLD else parent
            insert_rows(conn, target, 3, spec=SPEC)
            written += 3
            if phase.app.publishes_from in (Table.NEW, Table.OLD_THEN_NEW):
                publish_all(conn, parent)
        held = built.invariants(built.phases[-1].name)
        assert violations(conn, [c for _, c in held]) == []
        assert built.phases[-1].app.renamed  # --with-optional: the original-name phases ran
        if pattern in ("copra", "hoper", "hopia"):
            assert count(conn, old) == written
        else:
            assert count(conn, SPEC.retired_table) + count(conn, old) == written
