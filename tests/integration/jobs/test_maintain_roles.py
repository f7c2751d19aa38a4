"""`maintain --once` run as a role that does not own the partitions (the relay's, as
docs/roles.md describes it), on a real server.

PostgreSQL answers a VACUUM it will not run with a WARNING ("skipping …"), not an error: the
pass must not report the partition vacuumed then. Retention's DELETE without the privilege is
an error: the pass must still print its report, name the privilege and exit 5 (a
precondition), not exit 2 with no report. Before PostgreSQL 17 only the owner may vacuum; from
17 the MAINTAIN privilege (pg_maintain) allows it too, so this runs on the oldest and the
newest servers configured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_partitioned_outbox, insert_rows
from psycopg import sql

from outbox_migrate.jobs.maintain import published_settings
from tests.support.roles import DocumentedRoles


def _maintain(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "maintain", "--once", "--format", "json",
         "--dsn", dsn, *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _vacuum_count(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'outbox_unpublished'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _vacuum_count_once_at(dsn: str, least: int) -> int:
    """The count once it reached `least`: before PostgreSQL 15 the statistics collector
    reports a VACUUM some time after it ended (later still on a busy machine)."""
    deadline = time.monotonic() + 30
    while _vacuum_count(dsn) < least and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # a report still on its way would land now
    return _vacuum_count(dsn)


@pytest.fixture
def relay_outbox(roles: DocumentedRoles) -> DocumentedRoles:
    """A partitioned outbox the owner created (with the spec's autovacuum settings, as the
    migration's tune-autovacuum step leaves them), published rows in it, and the relay's
    grants: SELECT, UPDATE on the outbox and its partitions — no DELETE on the published one."""
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_partitioned_outbox(owner)
        insert_rows(owner, "outbox_new", 200)
        owner.execute("UPDATE outbox_new SET published_at = now() - interval '2 days' "
                      "WHERE id <= 150")  # fmt: skip
        settings = sql.SQL(", ").join(
            sql.SQL("{} = {}").format(sql.Identifier(k), sql.Literal(v))
            for k, v in published_settings().items()
        )
        owner.execute(sql.SQL("ALTER TABLE outbox_published SET ({})").format(settings))
    for table in ("outbox_new", "outbox_unpublished", "outbox_published"):
        roles.grant("SELECT, UPDATE", table, roles.relay)
    roles.grant_stats(roles.relay)
    return roles


@pytest.mark.pg_edges
def test_a_vacuum_the_server_skipped_is_not_reported_as_done(
    relay_outbox: DocumentedRoles,
) -> None:
    roles = relay_outbox
    before = _vacuum_count(roles.dsn)
    result = _maintain(roles.relay_dsn)
    assert result.returncode == 5, (result.stdout, result.stderr)
    report = json.loads(result.stdout)
    assert report["vacuumed"] is False
    [problem] = report["problems"]
    assert "outbox_unpublished" in problem and "not vacuumed" in problem
    assert "owner" in problem
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("outbox-migrate: error: ") and "not vacuumed" in line
    # The owner's pass vacuums, and says so.
    owner = _maintain(roles.owner_dsn)
    assert owner.returncode == 0, (owner.stdout, owner.stderr)
    assert json.loads(owner.stdout)["vacuumed"] is True
    # One VACUUM in all: PostgreSQL did skip the relay's (counted before the owner's ends).
    assert _vacuum_count_once_at(roles.dsn, before + 1) == before + 1


@pytest.mark.pg_edges
def test_retention_without_delete_prints_the_report_and_names_the_privilege(
    relay_outbox: DocumentedRoles,
) -> None:
    roles = relay_outbox
    result = _maintain(roles.relay_dsn, "--retention-days", "0")
    assert result.returncode == 5, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    report = json.loads(result.stdout)  # the report is printed either way
    retention = report["retention"]
    assert retention["deleted_rows"] == 0
    assert "DELETE" in retention["skipped"]
    assert any("DELETE" in p and "outbox_published" in p for p in report["problems"])
    assert (
        f'GRANT SELECT, DELETE ON "public"."outbox_published" TO "{roles.relay}"'
        in (retention["skipped"])
    )
    with psycopg.connect(roles.dsn, autocommit=True) as admin:
        count = admin.execute("SELECT count(*) FROM outbox_published").fetchone()
    assert count == (150,)
    # With the grant the docs name, the same role's retention runs.
    roles.grant("DELETE", "outbox_published", roles.relay)
    again = json.loads(_maintain(roles.relay_dsn, "--retention-days", "0").stdout)
    assert again["retention"]["deleted_rows"] == 150
    assert not any("DELETE" in p for p in again["problems"])


@pytest.mark.pg_edges
def test_a_role_with_pg_maintain_vacuums_from_postgresql_17(
    relay_outbox: DocumentedRoles, pg_server: object
) -> None:
    roles = relay_outbox
    with psycopg.connect(roles.dsn, autocommit=True) as admin:
        version = admin.info.server_version // 10000
        if version < 17:
            pytest.skip("pg_maintain exists from PostgreSQL 17")
        admin.execute(sql.SQL("GRANT pg_maintain TO {}").format(sql.Identifier(roles.relay)))
    before = _vacuum_count(roles.dsn)
    result = _maintain(roles.relay_dsn)
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert json.loads(result.stdout)["vacuumed"] is True
    assert _vacuum_count_once_at(roles.dsn, before + 1) == before + 1
