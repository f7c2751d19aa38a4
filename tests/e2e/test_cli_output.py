"""Output for people (issue 14): step ids are never truncated or split, tables fit 80
columns, and every boundary says what to do next with the options the user gave."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox

from outbox_migrate.patterns import PATTERN_NAMES, build_pattern
from tests.support.cli import run_cli


@pytest.mark.parametrize("columns", ["80", "120"])
@pytest.mark.parametrize("pattern", PATTERN_NAMES)
def test_plan_never_splits_a_step_id(pattern: str, columns: str) -> None:
    result = run_cli("plan", "-p", pattern, env={"COLUMNS": columns})
    assert result.returncode == 0, result.stderr
    for step in build_pattern(pattern).steps():
        assert step.id in result.stdout, (columns, step.id)


@pytest.mark.newest_pg_only
def test_status_fits_80_columns_with_whole_ids(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    ran = run_cli("run", "-p", "hoper", "--to", "V2", "--dsn", dsn)
    assert ran.returncode == 0, ran.stderr
    assert "Next: deploy application version V2" in ran.stdout
    assert "outbox-migrate run --pattern hoper --to V3" in ran.stdout
    shown = run_cli("status", "--dsn", dsn, env={"COLUMNS": "80"})
    assert shown.returncode == 0, shown.stderr
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80
    for step in build_pattern("hoper").steps():
        assert step.id in shown.stdout


def test_demo_report_fits_80_columns(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from outbox_migrate.cli import console

    monkeypatch.setenv("COLUMNS", "80")
    console.out.cache_clear()
    ids = [step.id for step in build_pattern("hoper").steps()]
    report = {
        "pattern": "hoper", "rate_per_s": 500, "produced": 10, "published": 10, "lost": 0,
        "duplicated": 0, "max_insert_latency_ms": 12.5, "lock_timeout_ms": 200,
        "p99_insert_latency_ms": 3.1, "max_publish_gap_ms": 250.0, "max_publish_lag_ms": 300.0,
        "phases": [{"phase": "V1", "seconds": 5.0, "inserts": 2500, "max_insert_latency_ms": 9.0,
                    "p99_insert_latency_ms": 2.0}],
        "steps": [{"step": i, "outcome": "done", "duration_ms": 12.3, "attempts": 1,
                   "lock_wait_ms": 0.0, "max_insert_latency_ms_during": 4.2} for i in ids],
    }  # fmt: skip
    try:
        console.render_demo_report(report)
    finally:
        console.out.cache_clear()
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines()) <= 80
    for step_id in ids:
        assert step_id in printed


def test_wizard_next_line_carries_the_options_given() -> None:
    result = run_cli(
        "wizard", "--no-pause", "--keep-old-rows", "--no-immediate-access",
        "--schema", "billing", "--table", "event_outbox",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    next_line = [line for line in result.stdout.splitlines() if line.startswith("Next:")][-1]
    assert "--schema billing --table event_outbox" in next_line
