"""Ctrl-C in the demo: out within a second, no traceback from any process, and an honest
partial report (before: 2.8-7.1 s, a multiprocessing traceback in 2 of 10 runs, `produced`
undercounted, and a window interrupted during V2's rollout labelled "V1")."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_migrate.errors import ExitCode
from tests.support.cli_process import LiveCli

EXIT_WITHIN_S = 1.0


def sessions_like(dsn: str, pattern: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s", (pattern,)
        ).fetchone()
    return int(row[0]) if row else 0


def demo_keys(dsn: str) -> int:
    """Distinct messages the demo's writers committed, counted in the database itself."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = [row[0] for row in conn.execute(
            "SELECT relname FROM pg_class WHERE relname IN ('outbox', 'outbox_new') "
            "AND relkind IN ('r', 'p')")]  # fmt: skip
        union = sql.SQL(" UNION ").join(
            sql.SQL("SELECT message_key FROM {} WHERE event_type = 'demo'").format(
                sql.Identifier(t)
            )
            for t in tables
        )
        row = conn.execute(sql.SQL("SELECT count(*) FROM ({}) s").format(union)).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.newest_pg_only
def test_ctrl_c_during_a_rollout(pg_server: Any, tmp_path: Path) -> None:
    server_dsn = pg_server.dsn()
    live = LiveCli(
        ("demo", "-p", "hoper", "--rate", "200", "--duration", "30", "--dsn", server_dsn,
         "--output-dir", str(tmp_path), "--format", "json"),
        new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 90
    while sessions_like(server_dsn, "demo-app/V2/writer-%") == 0:  # V2 is rolling out
        assert time.monotonic() < deadline and live.proc.poll() is None, live.end().stderr
        time.sleep(0.05)
    time.sleep(0.3)  # V1 and V2 side by side
    signalled = time.monotonic()
    live.signal_group(signal.SIGINT)  # what Ctrl-C in a terminal does
    live.proc.wait(30)
    took = time.monotonic() - signalled
    ended = live.end(timeout=30)
    assert ended.returncode == ExitCode.INTERRUPTED, ended
    assert "Traceback" not in ended.stderr, ended.stderr
    assert took < EXIT_WITHIN_S, took
    report = json.loads(ended.stdout)
    assert report["interrupted"] is True
    assert report["produced"] == demo_keys(pg_server.dsn(report["database"])) > 0
    assert [p["phase"] for p in report["phases"]] == ["V1", "V2"], report["phases"]
    assert (tmp_path / "hoper-report.html").exists()
