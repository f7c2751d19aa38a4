"""The CLI contract as a matrix: command by {bad input, precondition failed, interrupted,
connection lost} → the code docs/cli.md documents and exactly one `outbox-migrate: error:`
line, last on stderr, with no traceback. (Success of every command is run by
test_help_examples; SIGTERM and the demo's Ctrl-C by test_cli_exit_codes.)

A command is caught mid-work by making it wait: on a lock another session holds, or in the
V3 gate's sampling window. Then it gets SIGINT, or its backend is terminated — what a
server restart or a network cut does to it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.errors import ExitCode
from tests.support.cli import run_cli
from tests.support.cli_process import LiveCli, terminate_backends, wait_for_backend

pytestmark = pytest.mark.newest_pg_only  # exit paths, not server behaviour
BAD_NAME = ["--id-headroom", "-5"]


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("outbox-migrate: error: ")]
    assert len(errors) == 1, stderr
    assert stderr.strip().splitlines()[-1] == errors[0], stderr
    return errors[0]


# -- bad input: every command, one line, exit 2, before touching anything ------------------

BAD_INPUT = {
    "run": ["run", "-p", "hoper", "--to", "V2", *BAD_NAME],
    "next": ["next", "-p", "hoper", *BAD_NAME],
    "status": ["status", *BAD_NAME],
    "verify": ["verify", *BAD_NAME],
    "rollback": ["rollback", "--to", "V1", *BAD_NAME],
    "reset": ["reset", "--yes", *BAD_NAME],
    "plan": ["plan", "-p", "hoper", *BAD_NAME],
    "relay": ["relay", "--sink", "stdout", *BAD_NAME],
    "copy-back": ["copy-back", *BAD_NAME],
    "maintain": ["maintain", "--once", *BAD_NAME],
    "config": ["config", *BAD_NAME],
    "wizard": ["wizard", "--no-pause", "--keep-old-rows", *BAD_NAME],
    "alembic generate": ["alembic", "generate", "-p", "hoper", *BAD_NAME],
    "roles": ["roles", *BAD_NAME],
    "ping": ["ping", "--dsn", "postgresql://nobody@127.0.0.1:1/x?sslmode=bogus"],
    "demo": ["demo", "--rate", "0"],
}


@pytest.mark.newest_pg_only  # refused before any SQL: no server version can change it
@pytest.mark.parametrize("command", BAD_INPUT)
def test_bad_input(command: str, dsn: str) -> None:
    result = run_cli(*BAD_INPUT[command], "--dsn", dsn) if command not in (
        "config", "wizard", "alembic generate", "ping", "demo") else run_cli(*BAD_INPUT[command])  # fmt: skip
    assert result.returncode == ExitCode.USAGE, (result.returncode, result.stderr)
    one_error_line(result.stderr)
    if command != "demo":
        with psycopg.connect(dsn) as conn:  # nothing was touched, not even the ledger
            assert conn.execute("SELECT to_regnamespace('outbox_migrate')").fetchone() == (None,)


# -- precondition failed --------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["run", "-p", "copra", "--to", "V3"], ["next", "-p", "copra"], ["reset", "--yes"]],
)
def test_precondition_failed(command: list[str], dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5)
    assert run_cli("run", "-p", "copra", "--to", "V2", "--dsn", dsn).returncode == 0
    env = {"OUTBOX_MIGRATE_GATE_WINDOW_S": "0.1"}
    result = run_cli(*command, "--dsn", dsn, env=env)
    assert result.returncode == ExitCode.PRECONDITION, (result.returncode, result.stderr)
    assert "precondition" in one_error_line(result.stderr)


# -- interrupted / connection lost: each command caught while it waits ----------------------


@dataclass(frozen=True)
class Busy:
    args: tuple[str, ...]
    hold: str | None
    """SQL another session runs in an open transaction so the command waits on it."""
    waiting_on: str = "%"
    """pg_stat_activity.query pattern of the command's backend while it waits."""
    env: tuple[tuple[str, str], ...] = ()
    queues: bool = True
    """False when the command watches the holder instead of queueing on its lock (the
    runner's lock budget): then any query of its session shows it is at work."""


BUSY = {
    "run": Busy(("run", "-p", "hoper", "--to", "V3"), None, "%pg_sleep%",
                (("OUTBOX_MIGRATE_GATE_WINDOW_S", "30"),)),
    "next": Busy(("next", "-p", "hoper"), None, "%pg_sleep%",
                 (("OUTBOX_MIGRATE_GATE_WINDOW_S", "30"),)),
    "status": Busy(("status",), "LOCK TABLE outbox_migrate.migration IN ACCESS EXCLUSIVE MODE",
                   "%outbox_migrate.migration%"),
    "verify": Busy(("verify",), "LOCK TABLE outbox_migrate.migration IN ACCESS EXCLUSIVE MODE",
                   "%outbox_migrate.migration%"),
    "plan": Busy(("plan", "-p", "hoper"), "LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE"),
    "rollback": Busy(("rollback", "--to", "V1"), "LOCK TABLE outbox_new IN ACCESS EXCLUSIVE MODE",
                     "%pg_locks%", queues=False),
    "maintain": Busy(("maintain", "--once"), "LOCK TABLE outbox_new IN ACCESS EXCLUSIVE MODE"),
    "reset": Busy(("reset", "--yes", "--force"),  # at V2 steps are applied: --force
                  "SELECT * FROM outbox_migrate.migration FOR UPDATE", "%"),
}  # fmt: skip


@contextmanager
def holding(dsn: str, statement: str | None) -> Iterator[None]:
    if statement is None:
        yield
        return
    with psycopg.connect(dsn) as conn:
        conn.execute(statement)
        yield
        conn.rollback()


def at_v2(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    assert run_cli("run", "-p", "hoper", "--to", "V2", "--dsn", dsn).returncode == 0


def interrupt(live: LiveCli, dsn: str) -> None:
    live.signal(signal.SIGINT)


def cut(live: LiveCli, dsn: str) -> None:
    assert terminate_backends(dsn) >= 1


@pytest.mark.pg_edges
@pytest.mark.parametrize("command", BUSY)
@pytest.mark.parametrize(
    ("how", "code", "words"),
    [(interrupt, ExitCode.INTERRUPTED, "interrupted during"),
     (cut, ExitCode.CONNECTION_LOST, "lost the database connection")],
    ids=["interrupted", "connection-lost"],
)  # fmt: skip
def test_caught_mid_work(
    command: str, how: Callable[[LiveCli, str], None], code: int, words: str, dsn: str
) -> None:
    at_v2(dsn)
    busy = BUSY[command]
    with holding(dsn, busy.hold):
        live = LiveCli((*busy.args, "--dsn", dsn), env=dict(busy.env))
        try:
            wait_for_backend(
                dsn, query_like=busy.waiting_on, waiting=busy.queues and busy.hold is not None
            )
            how(live, dsn)
            ended = live.end(timeout=60)
        finally:
            if live.proc.poll() is None:
                live.proc.kill()
    assert ended.returncode == code, (ended.returncode, ended.stderr)
    line = one_error_line(ended.stderr)
    assert words in line and f"`{command}`" in line and "re-run the same command" in line
    assert "internal error" not in line


def test_matrix_covers_the_documented_codes() -> None:
    """docs/cli.md lists every code the CLI can exit with."""
    from pathlib import Path

    table = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    for code in ExitCode:
        assert f"\n| {int(code)} |" in table, code
