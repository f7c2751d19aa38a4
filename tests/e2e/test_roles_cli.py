"""`outbox-migrate roles` on a real server, as the roles the docs name: a migration at V2 run
by a non-superuser owner, an application role with INSERT and a relay role with SELECT and
UPDATE. Without the grants the docs ask for it names each gap and its cost and exits 5; with
them every check passes and it exits 0."""

from __future__ import annotations

import json
import subprocess

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox
from psycopg import sql

from outbox_migrate.config import load_settings
from outbox_migrate.runner import Runner
from tests.support.cli import run_cli
from tests.support.roles import DocumentedRoles

pytestmark = pytest.mark.newest_pg_only


@pytest.fixture
def at_v2(roles: DocumentedRoles) -> DocumentedRoles:
    with psycopg.connect(roles.owner_dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    roles.grant("INSERT", "outbox", roles.app)
    roles.grant("SELECT, UPDATE", "outbox", roles.relay)
    with Runner(roles.owner_dsn, load_settings({"gate_window_s": 0.1}, environ={}),
                "hoper") as runner:  # fmt: skip
        runner.run("V2")
    return roles


def checks(result: subprocess.CompletedProcess[str]) -> dict[tuple[str, str, str], bool | None]:
    """(role, duty, what) → ok, from `roles --format json`."""
    doc = json.loads(result.stdout)
    return {(c["role"], c["duty"], c["what"]): c["ok"] for c in doc["checks"]}


def test_missing_grants_are_named_with_their_cost(at_v2: DocumentedRoles) -> None:
    roles = at_v2
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        owner.execute(sql.SQL("REVOKE DELETE ON outbox_unpublished FROM {}").format(
            sql.Identifier(roles.relay)))  # fmt: skip
    args = ("roles", "--dsn", roles.owner_dsn, "--cdc-relay", roles.relay)
    result = run_cli(*args, "--format", "json")
    assert result.returncode == 5, result.stderr
    found = checks(result)
    see = "sight of other roles' sessions"
    assert found[(roles.owner, "runner", see)] is False
    assert found[(roles.owner, "runner", "owner of outbox")] is True
    # V2 inserts into the partitioned table; V1's INSERT on the flat one is to be revoked.
    assert found[(roles.app, "application", "INSERT on outbox_new")] is True
    assert found[(roles.relay, "relay", see)] is False
    assert found[(roles.relay, "relay", "DELETE on outbox_unpublished")] is False
    dead = "SELECT, INSERT, UPDATE, DELETE on outbox_dead_letter, outbox_dead_letter_attempts"
    assert found[(roles.relay, "relay", dead)] is True
    assert found[(roles.relay, "cdc relay", "REPLICATION")] is False
    assert "6 of 15 role checks fail" in result.stderr
    assert f"first: {roles.owner} (runner) is missing {see}" in result.stderr
    text = run_cli(*args, env={"COLUMNS": "200"})
    assert text.returncode == 5
    assert "--on-long-tx refuse refuses" in text.stdout
    assert "does not switch" in text.stdout
    assert f'GRANT DELETE ON "public"."outbox_unpublished" TO "{roles.relay}"' in text.stdout
    assert "the relay stops, the outbox with it" in text.stdout
    assert f'ALTER ROLE "{roles.relay}" REPLICATION' in text.stdout
    # No switching relay in COPRA: the relay need not see other roles' sessions.
    copra = checks(run_cli("roles", "--dsn", roles.owner_dsn, "-p", "copra", "--format", "json"))
    assert (roles.relay, "relay", see) not in copra
    assert copra[(roles.owner, "runner", see)] is False


def test_every_check_passes_with_the_documented_grants(at_v2: DocumentedRoles) -> None:
    roles = at_v2
    roles.grant_stats(roles.owner)
    roles.grant_stats(roles.relay)
    with psycopg.connect(roles.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("ALTER ROLE {} REPLICATION").format(sql.Identifier(roles.relay)))
        admin.execute(sql.SQL("CREATE PUBLICATION outbox_migrate_cdc FOR TABLE outbox_unpublished "
                              "WITH (publish = 'insert')"))  # fmt: skip
        admin.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
            sql.Identifier(admin.info.dbname), sql.Identifier(roles.relay)))  # fmt: skip
        admin.execute(sql.SQL("ALTER PUBLICATION outbox_migrate_cdc OWNER TO {}").format(
            sql.Identifier(roles.relay)))  # fmt: skip
    result = run_cli("roles", "--dsn", roles.relay_dsn, "--cdc-relay", roles.relay,
                     "--format", "json")  # fmt: skip
    assert result.returncode == 0, (result.stdout, result.stderr)
    found = checks(result)
    assert all(ok is not False for ok in found.values()), found
    duties = {(role, duty) for role, duty, _ in found}
    assert duties == {(roles.owner, "runner"), (roles.app, "application"),
                      (roles.relay, "relay"), (roles.relay, "cdc relay")}  # fmt: skip
    assert found[(roles.relay, "relay", "DELETE on outbox_unpublished")] is True


def test_a_role_that_does_not_exist_is_bad_input(at_v2: DocumentedRoles) -> None:
    result = run_cli("roles", "--dsn", at_v2.dsn, "--relay", "nosuch_role")
    assert result.returncode == 2
    assert result.stderr.strip() == "outbox-migrate: error: role nosuch_role does not exist"


def test_a_runner_that_is_not_the_owner_is_told_which_steps_fail(at_v2: DocumentedRoles) -> None:
    roles = at_v2
    result = run_cli("roles", "--dsn", roles.dsn, "--owner", roles.app, "--format", "json")
    assert result.returncode == 5, result.stderr
    doc = json.loads(result.stdout)
    runner = {c["what"]: c for c in doc["checks"] if c["duty"] == "runner"}
    assert runner["owner of outbox"]["ok"] is False
    assert "DDL fails" in runner["owner of outbox"]["cost"]
    assert runner["owner of outbox"]["fix"] == (
        f'run as {roles.owner}, or GRANT "{roles.owner}" TO "{roles.app}"'
    )
    assert runner["CREATE on schema public"]["ok"] is False  # PostgreSQL 15+: not PUBLIC's
    assert runner["CREATE on the database"]["ok"] is False
    assert doc["ok"] is False


@pytest.fixture
def at_v3(roles: DocumentedRoles) -> DocumentedRoles:
    """HOP completed as docs/roles.md and the playbook say: V2, then the REVOKE INSERT on the
    flat table `run --to V2` asks for (V3's gate waits for it), then V3."""
    with psycopg.connect(roles.owner_dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    roles.grant("INSERT", "outbox", roles.app)
    roles.grant("SELECT, UPDATE", "outbox", roles.relay)
    roles.grant_stats(roles.owner)
    roles.grant_stats(roles.relay)
    settings = load_settings({"gate_window_s": 0.1}, environ={})
    with Runner(roles.owner_dsn, settings, "hop") as runner:
        runner.run("V2")
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        owner.execute(sql.SQL("REVOKE INSERT ON outbox FROM {}").format(
            sql.Identifier(roles.app)))  # fmt: skip
    with Runner(roles.owner_dsn, settings, "hop") as runner:
        runner.run("V3")
    return roles


def test_a_completed_hop_migration_needs_only_the_partitioned_table(at_v3: DocumentedRoles) -> None:
    """After V3 the application inserts into, and the relay publishes from, the partitioned
    table only: `roles` must not ask to undo the REVOKE the V3 gate required, nor UPDATE on
    the flat table the partitioned relay never touches. Without --app the application is
    found by its INSERT on the partitioned table."""
    roles = at_v3
    for named in (("--app", roles.app, "--relay", roles.relay), ()):
        result = run_cli("roles", "--dsn", roles.owner_dsn, *named, "--format", "json")
        assert result.returncode == 0, (result.stdout, result.stderr)
        found = checks(result)
        assert found[(roles.app, "application", "INSERT on outbox_new")] is True
        claim = "SELECT, UPDATE on outbox_new, outbox_unpublished"
        assert found[(roles.relay, "relay", claim)] is True
        assert not any("on outbox," in what or what.endswith(" outbox")
                       for _, duty, what in found if duty != "runner"), found  # fmt: skip
        assert json.loads(result.stdout)["ok"] is True
    # The flat table's INSERT given back would be V1 again: not what V3 needs, not asked for.
    text = run_cli("roles", "--dsn", roles.owner_dsn, env={"COLUMNS": "200"})
    assert text.returncode == 0, (text.stdout, text.stderr)
    assert "GRANT INSERT" not in text.stdout


def test_an_application_not_found_is_said_not_checked(at_v2: DocumentedRoles) -> None:
    """No role but the owner has INSERT: the application's check cannot run, and neither the
    text nor the JSON may read as if it passed."""
    roles = at_v2
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        for table in ("outbox", "outbox_new", "outbox_unpublished"):
            owner.execute(sql.SQL("REVOKE INSERT ON {} FROM {}").format(
                sql.Identifier(table), sql.Identifier(roles.app)))  # fmt: skip
    args = ("roles", "--dsn", roles.owner_dsn, "--pattern", "copra")
    roles.grant_stats(roles.owner)
    text = run_cli(*args, env={"COLUMNS": "200"})
    assert text.returncode == 0, (text.stdout, text.stderr)
    assert "application: not checked" in text.stdout
    assert "--app" in text.stdout
    doc = json.loads(run_cli(*args, "--format", "json").stdout)
    assert doc["ok"] is None
    assert doc["not_checked"] == ["application"]


def test_a_table_that_does_not_exist_is_bad_input(at_v2: DocumentedRoles) -> None:
    """As `status --table nosuch`: one line, exit 2 — not a check of the partitioned table
    the default names point at."""
    result = run_cli("roles", "--table", "nosuch", "--dsn", at_v2.owner_dsn)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "public.nosuch does not exist" in line
    assert result.stdout == ""
