"""Exit codes a script can trust: every defect of issue 14's first bullets, observed end to end.

Each test here failed on the code before `cli/exits.py`: interrupts, a declined confirmation
and a lossy demo all exited 0, `OUTBOX_MIGRATE_DEBUG=1` was rejected as a configuration key,
and a terminated backend was an "internal error" with exit 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox
from outbox_migrate_harness.testing.server import free_port

from outbox_migrate.errors import ExitCode
from tests.support.cli import ERROR_PREFIX, error_line, run_cli
from tests.support.cli_process import LiveCli, terminate_backends, wait_for_backend

GATE = "hoper.v3.gate-old-table-retired"


def one_error_line(stderr: str) -> str:
    """The single `outbox-migrate: error:` line, last on stderr, with no traceback."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith(ERROR_PREFIX)]
    assert len(errors) == 1, stderr
    assert stderr.strip().splitlines()[-1] == errors[0], stderr
    return errors[0]


def at_v2(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    assert run_cli("run", "-p", "hoper", "--to", "V2", "--dsn", dsn).returncode == 0


def step_state(dsn: str, step: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT state FROM outbox_migrate.step WHERE step_id = %s", (step,)
        ).fetchone()
    assert row is not None
    return str(row[0])


def gate_run(dsn: str) -> LiveCli:
    """`run --to V3` parked in the V3 gate, which samples the old table for 30 s."""
    live = LiveCli(("run", "-p", "hoper", "--to", "V3", "--dsn", dsn),
                   env={"OUTBOX_MIGRATE_GATE_WINDOW_S": "30"})  # fmt: skip
    live.wait_for(GATE)
    wait_for_backend(dsn, query_like="%pg_sleep%")
    return live


@pytest.mark.newest_pg_only
@pytest.mark.parametrize(("signum", "code", "word"), [
    (signal.SIGINT, ExitCode.INTERRUPTED, "interrupted"),
    (signal.SIGTERM, ExitCode.TERMINATED, "terminated"),
])  # fmt: skip
def test_signal_during_a_step(dsn: str, signum: signal.Signals, code: int, word: str) -> None:
    at_v2(dsn)
    live = gate_run(dsn)
    started = time.monotonic()
    live.signal(signum)
    ended = live.end()
    assert ended.returncode == code, ended
    line = one_error_line(ended.stderr)
    assert word in line and GATE in line and "re-run the same command" in line
    assert time.monotonic() - started < 10  # the sampling query was cancelled, not awaited
    assert step_state(dsn, GATE) != "done"


@pytest.mark.newest_pg_only
def test_terminated_backend_is_a_lost_connection(dsn: str) -> None:
    at_v2(dsn)
    live = gate_run(dsn)
    assert terminate_backends(dsn) >= 1
    ended = live.end()
    assert ended.returncode == ExitCode.CONNECTION_LOST, ended
    line = one_error_line(ended.stderr)
    assert "internal error" not in line
    assert "lost the database connection" in line and GATE in line
    assert "re-run the same command" in line
    assert step_state(dsn, GATE) != "done"


def test_debug_variable_is_not_a_configuration_key() -> None:
    result = run_cli("config", "--format", "json", env={"OUTBOX_MIGRATE_DEBUG": "1"})
    assert result.returncode == 0, result.stderr
    assert '"debug"' not in result.stdout


def test_debug_variable_prints_the_traceback() -> None:
    dsn = f"postgresql://app:Sup3rSecret@127.0.0.1:{free_port()}/app"
    quiet = run_cli("ping", "--dsn", dsn)
    assert "Traceback" not in quiet.stderr
    loud = run_cli("ping", "--dsn", dsn, env={"OUTBOX_MIGRATE_DEBUG": "1"})
    assert loud.returncode == ExitCode.USAGE
    assert "Traceback" in loud.stderr
    assert loud.stderr.strip().splitlines()[-1].startswith(ERROR_PREFIX)
    assert run_cli("ping", "--dsn", dsn, env={"OUTBOX_MIGRATE_DEBUG": "0"}).stderr == quiet.stderr


def _on_a_terminal(*args: str) -> tuple[LiveCli, int]:
    """The CLI with a pseudo-terminal as stdin (so it asks), and the terminal's master side."""
    import pty

    master, slave = pty.openpty()
    live = LiveCli(args, stdin_fd=slave)
    os.close(slave)
    return live, master


@pytest.mark.newest_pg_only
def test_declined_reset_exits_1(dsn: str) -> None:
    at_v2(dsn)
    live, master = _on_a_terminal("reset", "-p", "hoper", "--dsn", dsn)
    try:
        live.wait_for("Abandon", stream="stdout")
        os.write(master, b"n\n")
        ended = live.end()
    finally:
        os.close(master)
    assert ended.returncode == ExitCode.FAILED, ended
    assert "not confirmed" in one_error_line(ended.stderr)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT state FROM outbox_migrate.migration").fetchone() == ("active",)


def test_ctrl_c_in_the_wizard_exits_130() -> None:
    live, master = _on_a_terminal("wizard")
    try:
        live.wait_for("?", stream="stdout")
        live.signal(signal.SIGINT)
        ended = live.end()
    finally:
        os.close(master)
    assert ended.returncode == ExitCode.INTERRUPTED, ended
    assert "interrupted during `wizard`" in one_error_line(ended.stderr)


def test_demo_that_lost_messages_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """The exit path only: the simulation itself is exercised by test_demo_under_load."""
    from outbox_migrate_harness import sim

    from outbox_migrate.cli import app, demo_cmd

    monkeypatch.setattr(
        demo_cmd,
        "run_databases",
        lambda dsn, prefix: contextlib.nullcontext(("dbname=main", "dbname=recording")),
    )
    monkeypatch.setattr(sim, "simulate", lambda *a, **k: {"lost": 3, "produced": 10})
    with pytest.raises(SystemExit) as ended:
        app.main(["demo", "--format", "json"])
    assert ended.value.code == ExitCode.FAILED
    assert "lost 3 messages" in one_error_line(capsys.readouterr().err)


def test_usage_error_from_typer_is_still_2() -> None:
    result = run_cli("run", "-p", "hoper")
    assert "--to" in error_line(result, ExitCode.USAGE, only=True)


def test_help_exits_0() -> None:
    result = subprocess.run([sys.executable, "-m", "outbox_migrate", "run", "--help"],
                            capture_output=True, text=True, check=False)  # fmt: skip
    assert result.returncode == 0 and "--to" in result.stdout


def sessions_like(dsn: str, pattern: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s", (pattern,)
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.newest_pg_only
def test_ctrl_c_stops_the_demo_cleanly(pg_server: Any, tmp_path: Any) -> None:
    """Ctrl-C reaches the demo and every child: before, each child printed a traceback, the
    parent waited ~60 s for relays that were already dead, then exited 0 with no report."""
    import json

    server_dsn = pg_server.dsn()
    live = LiveCli(
        ("demo", "-p", "hoper", "--rate", "50", "--duration", "60", "--dsn", server_dsn,
         "--output-dir", str(tmp_path), "--format", "json"),
        new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while sessions_like(server_dsn, "demo-app/%/relay-%") == 0:
        assert time.monotonic() < deadline and live.proc.poll() is None, live.end().stderr
        time.sleep(0.2)
    time.sleep(1)
    started = time.monotonic()
    live.signal_group(signal.SIGINT)
    ended = live.end(timeout=60)
    assert time.monotonic() - started < 30
    assert ended.returncode == ExitCode.INTERRUPTED, ended
    line = one_error_line(ended.stderr)
    assert "interrupted during `demo`" in line and "partial report" in line
    report = json.loads(ended.stdout)
    assert report["interrupted"] is True and report["produced"] > 0
    assert (tmp_path / "hoper-report.html").exists()
    for _ in range(50):  # the forkserver and the instances go with their parent
        if not live.group_alive() and sessions_like(server_dsn, "demo-app/%") == 0:
            break
        time.sleep(0.1)
    assert not live.group_alive()
    assert sessions_like(server_dsn, "demo-app/%") == 0
