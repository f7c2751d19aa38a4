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
    assert found[(roles.app, "application", "INSERT on outbox, outbox_new")] is True
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
