"""An interrupt says what it stopped, truthfully, at the exact instants where it used not to.

QA found a SIGINT a few milliseconds after a step's COMMIT reported "the step did not complete
and its transaction was rolled back" (exit 130) while the ledger said `done` and the DDL was
in place — on `run` and on `rollback` alike; and an interrupted rollback sometimes printed
psycopg's own "error ignored in rollback of <psycopg.Transaction …>" line, with host, user and
database, above the error line. Those instants are a few milliseconds wide, so here the
command runs in a subprocess whose runner is patched to send itself SIGINT exactly there: just
after a step's (or an inverse's) transaction committed, inside it before the commit, and with
the session still busy with a query when the transaction has to be rolled back.
"""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.errors import ExitCode
from tests.support.cli import ERROR_PREFIX, run_cli
from tests.support.roles import DocumentedRoles

pytestmark = pytest.mark.newest_pg_only  # what the CLI says, not what the server does

PATCHED_CLI = """
import os, signal, sys
from outbox_migrate.runner import apply, ledger, reverse

where, target = os.environ["OM_TEST_SIGINT"].split(":", 1)

def sigint():
    os.kill(os.getpid(), signal.SIGINT)  # the CLI's handler raises right after this returns

if where in ("after-commit", "after-ddl"):  # the runner's fault points, forward
    fault = apply.fault
    def patched_fault(step_id, point):
        if step_id == target and point == where:
            sigint()
        fault(step_id, point)
    apply.fault = patched_fault
elif where == "inverse-committed":
    run_inverse = reverse.run_inverse
    def patched_inverse(applier, step):
        run_inverse(applier, step)
        if step.id == target:
            sigint()
    reverse.run_inverse = patched_inverse
elif where == "inverse-busy":  # a query in flight when the inverse's transaction unwinds
    transition = ledger.transition
    def patched_transition(conn, migration_id, step_id, state, **kwargs):
        transition(conn, migration_id, step_id, state, **kwargs)
        if step_id == target and state == "rolled_back":
            conn.pgconn.send_query(b"SELECT pg_sleep(0.2)")
            sigint()
    ledger.transition = patched_transition

from outbox_migrate.cli.app import main
main(sys.argv[1:])
"""


def interrupted_at(where: str, step: str, *argv: str, dsn: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}
    env.update(COLUMNS="160", OM_TEST_SIGINT=f"{where}:{step}", OUTBOX_MIGRATE_GATE_WINDOW_S="0.1")
    return subprocess.run(
        [sys.executable, "-c", PATCHED_CLI, *argv, "--dsn", dsn],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=120,
        check=False,
    )  # fmt: skip


def the_one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """Exit 130, one error line, last on stderr; above it only the runner's progress (step
    names, summaries and outcomes), nothing of psycopg's."""
    assert result.returncode == ExitCode.INTERRUPTED, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith(ERROR_PREFIX)]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    for noise in ("Traceback", "psycopg", "error ignored", "host="):
        assert noise not in result.stderr, result.stderr
    return errors[0]


def state_of(dsn: str, step: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT state FROM outbox_migrate.step WHERE step_id = %s", (step,)
        ).fetchone()
    assert row is not None
    return str(row[0])


def relation_exists(dsn: str, name: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()
    return bool(row and row[0])


@pytest.fixture
def owner_dsn(roles: DocumentedRoles) -> str:
    """The default outbox, owned (and migrated) by a non-superuser owner."""
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_flat_outbox(owner)
        insert_rows(owner, "outbox", 20, published=True)
    return roles.owner_dsn


STEP = "hoper.v2.create-unpublished-partition"


def test_an_interrupt_just_after_a_step_committed_says_it_committed(owner_dsn: str) -> None:
    result = interrupted_at("after-commit", STEP, "run", "-p", "hoper", "--to", "V2",
                            dsn=owner_dsn)  # fmt: skip
    line = the_one_error_line(result)
    assert state_of(owner_dsn, STEP) == "done" and relation_exists(owner_dsn, "outbox_unpublished")
    assert f"after step {STEP} of `run` committed" in line, line
    assert "rolled back" not in line and "did not complete" not in line, line
    assert "re-run the same command" in line, line
    assert run_cli("run", "-p", "hoper", "--to", "V2", "--dsn", owner_dsn).returncode == 0


def test_an_interrupt_before_the_commit_still_says_rolled_back(owner_dsn: str) -> None:
    result = interrupted_at("after-ddl", STEP, "run", "-p", "hoper", "--to", "V2", dsn=owner_dsn)
    line = the_one_error_line(result)
    assert state_of(owner_dsn, STEP) == "pending"
    assert not relation_exists(owner_dsn, "outbox_unpublished")
    assert f"during step {STEP} of `run`" in line and "rolled back" in line, line


def test_an_interrupt_just_after_an_inverse_committed_says_it_committed(owner_dsn: str) -> None:
    assert run_cli("run", "-p", "hoper", "--to", "V2", "--dsn", owner_dsn).returncode == 0
    result = interrupted_at("inverse-committed", STEP, "rollback", "--to", "V1", dsn=owner_dsn)
    line = the_one_error_line(result)
    assert state_of(owner_dsn, STEP) == "rolled_back"
    assert not relation_exists(owner_dsn, "outbox_unpublished")
    assert f"after step {STEP} of `rollback` committed" in line, line
    assert "did not complete" not in line, line
    assert run_cli("rollback", "--to", "V1", "--dsn", owner_dsn).returncode == 0


def test_an_interrupt_on_a_busy_session_is_one_line_and_claims_nothing(owner_dsn: str) -> None:
    """The inverse's ROLLBACK cannot be sent while a query is in flight: psycopg logged
    "error ignored in rollback of <psycopg.Transaction …>" on stderr. The one line left says
    the step's outcome is not known to the command, and where to see it."""
    assert run_cli("run", "-p", "hoper", "--to", "V2", "--dsn", owner_dsn).returncode == 0
    result = interrupted_at("inverse-busy", STEP, "rollback", "--to", "V1", dsn=owner_dsn)
    line = the_one_error_line(result)
    assert "psycopg" not in result.stderr and "host=" not in result.stderr, result.stderr
    assert f"step {STEP} of `rollback`" in line and "outbox-migrate status" in line, line
    assert state_of(owner_dsn, STEP) == "done"  # the session ended: its transaction with it
    assert run_cli("rollback", "--to", "V1", "--dsn", owner_dsn).returncode == 0
