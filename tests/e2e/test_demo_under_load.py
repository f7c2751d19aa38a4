"""Every pattern under live load (the proof harness), CI-sized: nothing may be lost.

At 500 inserts/s with two relays per version: lost = 0 for every pattern; for the hot
patterns the longest insert stall stays within lock_timeout + 100 ms and the longest publish
gap within 2 s; for the cold ones the publication pause is measured and reported.

The harness exercises the whole stack against one server, so it runs on the newest
configured PostgreSQL only (the per-version behaviour is covered by the runner's tests).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest
from outbox_migrate_harness.sim import simulate
from outbox_migrate_harness.sim.scenario import Scenario
from outbox_migrate_harness.testing.server import Server
from psycopg import sql

from outbox_migrate.patterns import PATTERN_NAMES

HOT = {"hop", "hoper", "hopia"}
CI_DURATION_S = 10.0
RATE = 500


@pytest.fixture
def recording_dsn(pg_server: Server, dsn: str) -> str:
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"] + "_rec"
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield pg_server.dsn(name)
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.mark.newest_pg_only
@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERN_NAMES)
def test_pattern_under_load(pattern: str, dsn: str, recording_dsn: str, tmp_path: Path) -> None:
    report = simulate(
        dsn, recording_dsn, Scenario(pattern, rate_per_s=RATE, duration_s=CI_DURATION_S),
        output_dir=tmp_path,
    )  # fmt: skip
    summary = {k: report[k] for k in ("produced", "published", "lost", "duplicated",
                                      "max_insert_latency_ms", "max_publish_gap_ms")}  # fmt: skip
    assert report["produced"] > RATE * CI_DURATION_S * 0.5, summary
    assert report["lost"] == 0, report["lost_keys"]
    assert report["published"] == report["produced"]
    assert report["insert_errors"] == 0, report["insert_error_samples"]
    assert report["relay_errors"] == []
    assert report["backlog_left"] == 0
    # adopted: the relays made the dead-letter tables before V2 (as a relay does when it may)
    assert all(step["outcome"] in ("done", "adopted") for step in report["steps"]), report["steps"]
    if pattern in HOT:
        # A step may stall an insert for at most lock_timeout, on top of what an insert
        # takes on this machine at this moment when no step runs (load, not the migration).
        noise_ms = max(100.0, report["max_insert_latency_ms_outside_steps"])
        during = max(step["max_insert_latency_ms_during"] for step in report["steps"])
        assert during <= report["lock_timeout_ms"] + noise_ms, (summary, noise_ms)
        assert report["max_publish_gap_ms"] <= 2000, summary
    else:
        assert report["pause_ms"] > 0
    assert Path(report["files"]["html"]).exists()
    assert Path(report["files"]["png"]).stat().st_size > 10_000


@pytest.mark.newest_pg_only
@pytest.mark.slow
def test_wrong_choreography_is_stopped(dsn: str, recording_dsn: str) -> None:
    """V3 deployed while a V1 writer still runs: the gate refuses, the rows it would have
    stranded are named, and once the stray writer is gone the rollout finishes losing nothing."""
    report = simulate(dsn, recording_dsn, Scenario("hop", duration_s=12, wrong_choreography=True))
    refusal = report["refusal"]
    assert refusal is not None and refusal["refused"] is True
    assert refusal["step"] == "hop.v3.gate-old-table-retired"
    assert "still receiving inserts" in refusal["observed"] or "sessions" in refusal["observed"]
    strand = refusal["would_strand"]
    assert strand["count"] > 0
    assert all(key.startswith("V1-w0-") for key in strand["first_keys"])
    assert report["lost"] == 0


@pytest.mark.newest_pg_only
def test_demo_command_on_the_embedded_server(tmp_path: Path) -> None:
    """The README's main command, as a user runs it (short): embedded server, JSON report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}
    # Not under tmp_path: as root the server runs as another user, which needs to traverse
    # the directory's parents, and each xdist worker's pytest makes `pytest-of-<user>` 0700
    # again when it creates its own base directory.
    data_root = Path(tempfile.mkdtemp(prefix="om-demo-"))
    env["OUTBOX_MIGRATE_EMBEDDED_DIR"] = str(data_root / "pgdata")
    result = subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "demo", "--pattern", "cop", "--duration", "6",
         "--format", "json", "--output-dir", str(tmp_path / "reports")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    shutil.rmtree(data_root, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    for key in ("produced", "published", "lost", "duplicated", "max_insert_latency_ms",
                "max_publish_gap_ms"):  # fmt: skip
        assert key in report
    assert report["lost"] == 0 and report["produced"] > 0
    assert (tmp_path / "reports" / "cop-report.html").exists()


@pytest.mark.newest_pg_only
@pytest.mark.slow
def test_two_demos_on_one_server_both_finish(pg_server: Server, tmp_path: Path) -> None:
    """Each run has databases of its own: a second demo on the same server neither replaces
    nor ends the first (fixed names dropped WITH (FORCE) ended the one already running)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}
    runs = []
    for n in range(2):
        command = [
            sys.executable, "-m", "outbox_migrate", "demo", "--pattern", "cop", "--rate", "200",
            "--duration", "6", "--format", "json", "--dsn", pg_server.dsn(),
            "--output-dir", str(tmp_path / f"run{n}"),
        ]  # fmt: skip
        runs.append(
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        )
    reports = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-2000:]
        reports.append(json.loads(out))
    assert all(r["lost"] == 0 and r["produced"] > 0 for r in reports), reports
    assert reports[0]["database"] != reports[1]["database"]


@pytest.mark.newest_pg_only
def test_a_later_run_drops_only_ended_runs_databases(pg_server: Server) -> None:
    """What a run leaves is dropped by the next one — unless somebody is still connected to
    it, or it is not a run's database at all (no marking comment)."""
    from outbox_migrate.cli.demo_cmd import run_databases

    with run_databases(pg_server.dsn()) as (first, _):
        pass
    with run_databases(pg_server.dsn()) as (watched, _):
        pass
    with psycopg.connect(pg_server.dsn(), autocommit=True) as admin:
        admin.execute("DROP DATABASE IF EXISTS outbox_demo_users_own")
        admin.execute("CREATE DATABASE outbox_demo_users_own")
        try:
            with psycopg.connect(watched), run_databases(pg_server.dsn()) as (latest, _):
                names = {row[0] for row in admin.execute("SELECT datname FROM pg_database")}
                first_name, watched_name, latest_name = (
                    psycopg.conninfo.conninfo_to_dict(d)["dbname"] for d in (first, watched, latest)
                )
                assert first_name not in names and f"{first_name}_recording" not in names
                assert watched_name in names  # somebody is looking at it
                assert latest_name in names and "outbox_demo_users_own" in names
        finally:
            admin.execute("DROP DATABASE outbox_demo_users_own")
