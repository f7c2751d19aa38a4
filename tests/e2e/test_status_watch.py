"""`status --watch`: a blocked step's blocker and a gate's reason show within one refresh.

Real sessions hold the lock and leave the row unpublished; the runner that waits is a real
`run` process. The frames are read as a user piping the command would (not a terminal: plain
frames, 80 columns).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from tests.support.cli import run_cli

GATE_ENV = {"OUTBOX_MIGRATE_GATE_WINDOW_S": "0.1"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env={**GATE_ENV, "COLUMNS": "80"})


def test_watch_shows_the_session_a_waiting_step_needs_gone(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    for phase in ("V2", "V3"):
        assert _cli("run", "--pattern", "hoper", "--to", phase, "--dsn", dsn).returncode == 0
    blocker = psycopg.connect(dsn, application_name="report-job")
    blocker.execute("SELECT count(*) FROM outbox")  # ACCESS SHARE, then idle in transaction
    blocker_pid = blocker.info.backend_pid
    runner = subprocess.Popen(
        [*_module(), "run", "--pattern", "hoper", "--to", "V4", "--dsn", dsn,
         "--lock-budget-s", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    try:
        _wait_for_runner(dsn)
        watched = _cli("status", "--watch", "--interval", "0.5", "--count", "2", "--dsn", dsn)
        assert watched.returncode == 0, watched.stderr
        frame = watched.stdout
        assert "next step: hoper.v4.drop-identity" in frame
        assert "needs ACCESS EXCLUSIVE on outbox" in frame
        assert f"blocked by pid {blocker_pid} (report-job, idle in transaction" in frame
        assert "runner: pid" in frame
        assert max(len(line) for line in frame.splitlines()) <= 80
    finally:
        blocker.rollback()
        blocker.close()
        _out, err = runner.communicate(timeout=120)
    assert runner.returncode == 0, err


def test_watch_shows_what_a_gate_waits_for(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    assert _cli("run", "--pattern", "hoper", "--to", "V2", "--dsn", dsn).returncode == 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        insert_rows(conn, "outbox", 3)  # V1 left three rows unpublished in the old table
    watched = _cli("status", "--watch", "--count", "1", "--format", "json", "--dsn", dsn)
    assert watched.returncode == 0, watched.stderr
    frame = json.loads(watched.stdout.splitlines()[0])
    assert frame["next_step"]["id"] == "hoper.v3.gate-old-table-retired"
    reasons = {c["check"]: c["observed"] for c in frame["checks"]}
    assert "old-table-drained:outbox" in reasons, reasons
    assert "3 unpublished" in reasons["old-table-drained:outbox"]
    backlog = {t["table"]: t["unpublished"] for t in frame["relay"]}
    assert backlog["outbox"] == 3
    text = _cli("status", "--watch", "--count", "1", "--dsn", dsn)
    assert "not yet:" in text.stdout and "old-table-drained:outbox" in text.stdout


@pytest.mark.newest_pg_only
def test_two_watches_beside_a_run_are_never_what_it_waits_for(dsn: str) -> None:
    """Two watches refreshing every 0.1 s while `run --to V4` takes its ACCESS EXCLUSIVE
    locks: the runner never names a watch as a holder (the watch read V4's sampled gate for
    its whole window, holding the old table, and the runner waited for it), and Ctrl-C leaves
    a watch with exit 0 and no error line."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 2000, published=True)
    for phase in ("V2", "V3"):
        assert _cli("run", "--pattern", "hoper", "--to", phase, "--dsn", dsn).returncode == 0
    watches = [
        subprocess.Popen(
            [*_module(), "status", "--watch", "--interval", "0.1", "--dsn", dsn],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(gate_window=False),
        )
        for _ in range(2)
    ]
    try:
        time.sleep(1.5)  # both are watching
        # The default gate window (2 s), as an operator runs both.
        run = run_cli("run", "--pattern", "hoper", "--to", "V4", "--lock-budget-s", "30",
                      "--dsn", dsn)  # fmt: skip
    finally:
        for watch in watches:
            watch.send_signal(signal.SIGINT)
        ended = [watch.communicate(timeout=30) for watch in watches]
    assert run.returncode == 0, run.stderr
    assert "status --watch" not in run.stderr
    for watch, (out, err) in zip(watches, ended, strict=True):
        assert watch.returncode == 0, err
        assert err == ""
        assert "next step" in out or "steps:" in out
    with psycopg.connect(dsn, autocommit=True) as conn:
        named = conn.execute(
            "SELECT count(*) FROM outbox_migrate.attempt WHERE blockers::text LIKE %s",
            ("%status --watch%",),
        ).fetchone()
    assert named == (0,)


def _module() -> list[str]:
    import sys

    return [sys.executable, "-m", "outbox_migrate"]


def _env(*, gate_window: bool = True) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}
    return env | GATE_ENV if gate_window else env


def _wait_for_runner(dsn: str, timeout_s: float = 30.0) -> None:
    """Until the runner holds its advisory lock (it is then at work on the table)."""
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND classid = %s",
                (0x6F6D7275,),
            ).fetchone()
            if row and row[0]:
                time.sleep(0.5)  # past its first look at the blockers
                return
            time.sleep(0.05)
    raise AssertionError("the runner never took its advisory lock")
