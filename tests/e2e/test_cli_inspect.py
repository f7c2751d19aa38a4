"""`status`, `verify` and `plan` for a role that may only read, and inspection that cannot
pass on nothing (issue 14: they ran `ensure_schema`, needed `--pattern`, and `verify` of a
table that does not exist said every invariant held)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_migrate.errors import ExitCode
from tests.support.cli import error_line, run_cli

pytestmark = pytest.mark.newest_pg_only  # permissions and catalog reads, not version behaviour


@pytest.fixture
def reader(dsn: str) -> Iterator[str]:
    """A DSN for a new role with CONNECT on the database and SELECT on public's tables only."""
    role = f"om_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(sql.SQL("REVOKE CREATE ON SCHEMA public FROM PUBLIC"))
        conn.execute(
            sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
                sql.Identifier(conn.info.dbname), sql.Identifier(role)
            )
        )
        conn.execute(
            sql.SQL(
                "ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {}"
            ).format(sql.Identifier(role))
        )
        conn.execute(
            sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {}").format(
                sql.Identifier(role)
            )
        )
    try:
        yield make_conninfo(dsn, user=role)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def grant_ledger(dsn: str, reader_dsn: str) -> None:
    role = psycopg.conninfo.conninfo_to_dict(reader_dsn)["user"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("GRANT USAGE ON SCHEMA outbox_migrate TO {}").format(sql.Identifier(role))
        )
        conn.execute(
            sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA outbox_migrate TO {}").format(
                sql.Identifier(role)
            )
        )
        conn.execute(
            sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {}").format(
                sql.Identifier(role)
            )
        )


def test_status_before_any_migration_needs_no_write_rights(dsn: str, reader: str) -> None:
    result = run_cli("status", "--dsn", reader)
    assert result.returncode == 0, result.stderr
    assert "no migration recorded for public.outbox" in result.stdout
    with psycopg.connect(dsn) as conn:  # and it created nothing
        assert conn.execute("SELECT to_regnamespace('outbox_migrate')").fetchone() == (None,)
    doc = json.loads(run_cli("status", "--dsn", reader, "--format", "json").stdout)
    assert doc["recorded"] is False and doc["steps"] == []


def test_verify_before_any_migration_fails(reader: str) -> None:
    line = error_line(run_cli("verify", "--dsn", reader), ExitCode.FAILED, only=True)
    assert "no migration recorded for public.outbox" in line


def test_plan_with_a_read_only_role(reader: str) -> None:
    result = run_cli("plan", "-p", "hoper", "--dsn", reader, "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["facts"]["table"]


def test_status_and_verify_default_to_the_active_migration(dsn: str, reader: str) -> None:
    assert run_cli("run", "-p", "hoper", "--to", "V2", "--dsn", dsn).returncode == 0
    no_grant = error_line(run_cli("status", "--dsn", reader), ExitCode.USAGE, only=True)
    assert "GRANT USAGE ON SCHEMA outbox_migrate" in no_grant
    grant_ledger(dsn, reader)
    doc = json.loads(run_cli("status", "--dsn", reader, "--format", "json").stdout)
    assert (doc["pattern"], doc["phase"], doc["next_phase"]) == ("hoper", "V2", "V3")
    verified = run_cli("verify", "--dsn", reader)
    assert verified.returncode == 0, verified.stderr
    assert "phase V2 holds" in verified.stdout
    other = run_cli("status", "-p", "hop", "--dsn", reader)
    assert "no HOP migration recorded for public.outbox (a HOPER migration is active)" in (
        other.stdout
    )


def test_verify_catches_a_broken_invariant(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    assert run_cli("run", "-p", "hoper", "--to", "V2", "--dsn", dsn).returncode == 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE outbox_published")
    line = error_line(run_cli("verify", "--dsn", dsn), ExitCode.FAILED, only=True)
    assert "invariants of phase V2 do not hold" in line
    # --format json printed nothing on a failure: the document lists the violations
    as_json = run_cli("verify", "--dsn", dsn, "--format", "json")
    assert error_line(as_json, ExitCode.FAILED, only=True) == line
    document = json.loads(as_json.stdout)
    assert document["phase"] == "V2" and document["violations"]
    assert any("outbox_published" in v for v in document["violations"])


@pytest.mark.parametrize("command", ["verify", "status"])
def test_inspecting_a_table_that_does_not_exist_is_bad_input(dsn: str, command: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    result = run_cli(command, "-p", "hoper", "--table", "nosuch", "--dsn", dsn)
    assert "public.nosuch does not exist" in error_line(result, ExitCode.USAGE, only=True)


def test_rollback_defaults_to_the_active_migration(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    assert run_cli("run", "-p", "hoper", "--to", "V2", "--dsn", dsn).returncode == 0
    result = run_cli("rollback", "--to", "V1", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert "now at the end of V1" in result.stdout
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('outbox_new')").fetchone() == (None,)


def test_rollback_with_nothing_recorded(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    line = error_line(run_cli("rollback", "--to", "V1", "--dsn", dsn), ExitCode.USAGE, only=True)
    assert "no migration recorded for public.outbox" in line
