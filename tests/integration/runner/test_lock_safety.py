"""Lock safety: the runner never parks writers behind its ACCESS EXCLUSIVE requests for long.

A session holds a lock the swap needs; the runner's attempts time out after lock_timeout and
retry with backoff. A writer inserting all the while must never wait longer than
lock_timeout + 100 ms, the blocker must be named, and an exhausted budget must leave nothing
half-applied.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psycopg
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.config import load_settings
from outbox_migrate.runner import Runner
from tests.support.app import publish_all
from tests.support.cli_process import until_counted

LOCK_TIMEOUT_MS = 200
BLOCKER_APP = "nightly-report-job"


def prepare_hoper_v3(dsn: str) -> None:
    settings = load_settings({"gate_window_s": 0.1}, environ={})
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 2000, published=True)
        with Runner(dsn, settings, "hoper") as runner:
            runner.run("V2")
        insert_rows(conn, "outbox_new", 50)
        publish_all(conn, "outbox_new")
        with Runner(dsn, settings, "hoper") as runner:
            runner.run("V3")


class Writer(threading.Thread):
    """Inserts into the partitioned outbox in a loop, recording each insert's latency."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    conn.execute("INSERT INTO outbox_new (payload) VALUES ('{}')")
                except psycopg.Error as exc:
                    self.errors.append(str(exc))
                self.latencies.append(time.perf_counter() - started)
                time.sleep(0.005)


def hold_lock_on_published(dsn: str) -> psycopg.Connection:
    """An idle-in-transaction reader of the published partition (a classic real blocker)."""
    blocker = psycopg.connect(dsn, application_name=BLOCKER_APP)
    blocker.execute("SELECT count(*) FROM outbox_published").fetchone()
    return blocker


def run_cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_MIGRATE_")}
    env["OUTBOX_MIGRATE_GATE_WINDOW_S"] = "0.1"
    return subprocess.run(
        [sys.executable, "-m", "outbox_migrate", *args, "--dsn", dsn],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_budget_exhausted_names_blocker_and_applies_nothing(dsn: str) -> None:
    prepare_hoper_v3(dsn)
    blocker = hold_lock_on_published(dsn)
    blocker_pid = blocker.info.backend_pid
    writer = Writer(dsn)
    writer.start()
    try:
        result = run_cli(
            dsn,
            "run",
            "--pattern",
            "hoper",
            "--to",
            "V4",
            "--lock-timeout-ms",
            str(LOCK_TIMEOUT_MS),
            "--lock-budget-s",
            "2",
        )
    finally:
        writer.stop.set()
        writer.join(10)
        blocker.close()
    assert result.returncode == 4, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("outbox-migrate: error: hoper.v4.swap-default: could not take its locks")
    assert f"pid {blocker_pid}" in last and BLOCKER_APP in last
    assert "nothing was applied" in last
    # Each attempt was reported with the blocker while it ran.
    # (progress lines wrap to the terminal's width: compare with whitespace collapsed)
    assert f"held by pid {blocker_pid} ({BLOCKER_APP}" in " ".join(result.stderr.split())
    assert writer.errors == []
    assert len(writer.latencies) > 20
    assert max(writer.latencies) <= (LOCK_TIMEOUT_MS + 100) / 1000, max(writer.latencies)
    with psycopg.connect(dsn, autocommit=True) as conn:
        bounds = dict(
            conn.execute(
                "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
                "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'outbox_new'::regclass"
            ).fetchall()
        )
        assert bounds == {
            "outbox_published": "DEFAULT",
            "outbox_unpublished": "FOR VALUES IN (NULL)",
        }
        state = conn.execute(
            "SELECT state, attempts >= 1, last_error IS NOT NULL FROM outbox_migrate.step "
            "WHERE step_id = 'hoper.v4.swap-default'"
        ).fetchone()
        assert state == ("failed", True, True)
        recorded = conn.execute(
            "SELECT count(*) FROM outbox_migrate.attempt WHERE step_id = 'hoper.v4.swap-default' "
            "AND outcome = 'waiting' AND blockers::text LIKE %s",
            (f"%{BLOCKER_APP}%",),
        ).fetchone()
        assert recorded is not None and recorded[0] >= 1  # watched, never queued


def _release_once_watched(dsn: str, blocker: psycopg.Connection, watched_s: float) -> None:
    """Close `blocker` `watched_s` after the runner recorded that it is watching it, not after
    a fixed time: on a loaded machine the runner may reach the step only as a timer fires."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        until_counted(
            conn,
            "SELECT count(*) FROM outbox_migrate.attempt "
            "WHERE step_id = 'hoper.v4.swap-default' AND outcome = 'waiting'",
            what="the runner's waiting attempt",
        )
    time.sleep(watched_s)
    blocker.close()


def test_retries_succeed_once_the_blocker_leaves(dsn: str) -> None:
    prepare_hoper_v3(dsn)
    blocker = hold_lock_on_published(dsn)
    releaser = threading.Thread(
        target=_release_once_watched, args=(dsn, blocker, 2 * LOCK_TIMEOUT_MS / 1000)
    )
    releaser.start()
    settings = load_settings({"gate_window_s": 0.1, "lock_budget_s": 30}, environ={})
    try:
        with Runner(dsn, settings, "hoper") as runner:
            result = runner.run("V4")
    finally:
        releaser.join()
    assert result.phase == "V4"
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT state, attempts, lock_wait_ms FROM outbox_migrate.step "
            "WHERE step_id = 'hoper.v4.swap-default'"
        ).fetchone()
    assert row is not None
    assert row[0] == "done" and row[1] >= 2 and row[2] >= LOCK_TIMEOUT_MS


def test_refuse_policy_reports_long_transactions(dsn: str) -> None:
    prepare_hoper_v3(dsn)
    blocker = hold_lock_on_published(dsn)
    time.sleep(1.2)  # older than the long-transaction threshold
    try:
        result = run_cli(dsn, "run", "--pattern", "hoper", "--to", "V4", "--on-long-tx", "refuse")
    finally:
        blocker.close()
    assert result.returncode == 4, result.stderr
    assert "refusing to queue an ACCESS EXCLUSIVE lock behind pid" in result.stderr
    assert BLOCKER_APP in result.stderr
