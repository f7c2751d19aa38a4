"""`status` shows where a step stands now: its error once (the footer said
"hoper.v4.drop-identity: hoper.v4.drop-identity: …"), and a lock attempt recorded after that
error instead of the error (it kept showing the first run's budget error after later
attempts, e.g. of a run that was interrupted while it retried)."""

from __future__ import annotations

import json

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox

from outbox_migrate.errors import ExitCode
from tests.support.cli import run_cli

STEP = "hoper.v4.drop-identity"


@pytest.mark.newest_pg_only
def test_status_shows_the_latest_attempt_once(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    env = {"OUTBOX_MIGRATE_GATE_WINDOW_S": "0.2"}
    for phase in ("V2", "V3"):
        ran = run_cli("run", "-p", "hoper", "--to", phase, "--dsn", dsn, env=env)
        assert ran.returncode == 0, ran.stderr
    # A reader's open transaction: V4's first step waits for its lock (a writer's would be
    # refused by the gate first: its insert ticked the gate sequence)
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT count(*) FROM outbox")
        failed = run_cli("run", "-p", "hoper", "--to", "V4", "--dsn", dsn,
                         "--lock-budget-s", "0.5", "--lock-timeout-ms", "100", env=env)  # fmt: skip
        assert failed.returncode == ExitCode.LOCK_BUDGET, failed.stderr
        shown = run_cli("status", "--dsn", dsn, env={"COLUMNS": "200"})
        footer = [line for line in shown.stdout.splitlines() if line.startswith(f"{STEP}:")]
        assert footer and f"{STEP}: {STEP}" not in shown.stdout, shown.stdout
        assert "could not take its locks" in footer[0]
        # A later run retried and was cut short: its attempt is in the ledger, its error not.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO outbox_migrate.attempt "
                "(migration_id, step_id, attempt, at, outcome, waited_ms, blockers) "
                "SELECT migration_id, step_id, 7, now() + interval '1 s', 'lock_timeout', "
                "100, %s FROM outbox_migrate.step WHERE step_id = %s",
                (json.dumps([{"pid": 4242, "application_name": "billing-v1"}]), STEP),
            )
        later = run_cli("status", "--dsn", dsn, env={"COLUMNS": "200"})
    footer = [line for line in later.stdout.splitlines() if line.startswith(f"{STEP}:")]
    assert len(footer) == 1, later.stdout
    assert "latest attempt 7" in footer[0] and "lock not granted" in footer[0]
    assert "pid 4242 (billing-v1)" in footer[0]
    assert "could not take its locks" not in later.stdout
