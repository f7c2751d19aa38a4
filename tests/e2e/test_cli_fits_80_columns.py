"""Every command's output for people fits an 80-column terminal (issue: `plan` printed tables
97-99 columns wide and prose lines up to 215, the main `--help` lines up to 97, `config`
folded table names mid-word, the demo's step table split "outco/me").

The commands run as a user runs them, at COLUMNS=80, on one database, in an operator's order,
with long names (the widest realistic case). `plan --format sql` is laid out to the width too.
Machine formats (`--format json|markdown`) and data a sink prints are not for people and are
not checked here; error lines are one line by contract (docs/cli.md) and none is expected.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import PATTERN_NAMES, BuildOptions, build_pattern

WIDTH = 80
SPEC = replace(
    OutboxSpec(), schema="billing", table="customer_order_events_outbox",
    partitioned_table="customer_order_events_partitioned",
    unpublished_partition="customer_order_events_unpublished",
    published_partition="customer_order_events_published",
)  # fmt: skip
NAMES = {
    "OUTBOX_MIGRATE_SCHEMA": SPEC.schema, "OUTBOX_MIGRATE_TABLE": SPEC.table,
    "OUTBOX_MIGRATE_PARTITIONED_TABLE": SPEC.partitioned_table,
    "OUTBOX_MIGRATE_UNPUBLISHED_PARTITION": SPEC.unpublished_partition,
    "OUTBOX_MIGRATE_PUBLISHED_PARTITION": SPEC.published_partition,
}  # fmt: skip


def every_command() -> list[tuple[str, ...]]:
    import typer.main

    from outbox_migrate.cli.app import app

    found: list[tuple[str, ...]] = [()]
    pending: list[tuple[tuple[str, ...], Any]] = [((), typer.main.get_command(app))]
    while pending:
        path, command = pending.pop()
        for name, sub in (getattr(command, "commands", None) or {}).items():
            found.append((*path, name))
            pending.append(((*path, name), sub))
    return found


def cli(*args: str, env: dict[str, str], cwd: Path | None = None) -> tuple[str, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}
    full |= {"COLUMNS": str(WIDTH), **env}
    result = subprocess.run(
        [sys.executable, "-m", "outbox_migrate", *args], capture_output=True, text=True,
        env=full, cwd=cwd, stdin=subprocess.DEVNULL, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (args, result.stdout[-1500:], result.stderr[-1500:])
    return result.stdout, result.stderr


def too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > WIDTH]


@pytest.mark.parametrize("command", every_command(), ids=lambda c: " ".join(c) or "main")
def test_help_fits(command: tuple[str, ...]) -> None:
    out, _ = cli(*command, "--help", env={})
    assert too_wide(out) == []


def test_output_without_a_database_fits() -> None:
    config, _ = cli("config", env=NAMES)
    for name in NAMES.values():  # whole, never folded mid-word
        assert name in config.split(), name
    outputs = [
        (config, ""),
        cli("config", "--old-app-name", "billing-service-v1-%", env=NAMES),
        cli("wizard", "--no-pause", "--keep-old-rows", "--no-immediate-access", env=NAMES),
    ]
    for pattern in PATTERN_NAMES:
        out, err = cli("plan", "-p", pattern, "--with-optional", env=NAMES)
        outputs.append((out, err))
        for step in build_pattern(pattern, SPEC, BuildOptions(include_optional=True)).steps():
            assert step.id in out.split(), step.id  # whole, on a line of its own
    for out, err in outputs:
        assert too_wide(out) == [] and too_wide(err) == []


def outside_function_bodies(sql_text: str) -> str:
    """`sql_text` without the bodies of the functions it creates: PostgreSQL stores a body
    verbatim, so the layout leaves it as `run` and Alembic create it (docs/plan.md)."""
    kept: list[str] = []
    statement = ""
    closing: str | None = None
    for line in sql_text.splitlines():
        if closing is not None:
            closing = None if closing in line else closing
            continue
        kept.append(line)
        statement += line + " "
        tag = re.search(r" AS (\$[A-Za-z_]*\$)\s*$", line)
        if tag and re.match(r"\s*CREATE (OR REPLACE )?FUNCTION\b", statement):
            closing = tag.group(1)
        if line.rstrip().endswith(";"):
            statement = ""
    return "\n".join(kept)


@pytest.mark.parametrize("pattern", PATTERN_NAMES)
def test_plan_sql_is_laid_out_to_fit(pattern: str) -> None:
    """psql runs it as laid out at 80 columns: tests/e2e/test_plan_sql_with_psql.py. A
    function's body is left as PostgreSQL stores it, whatever its width."""
    out, _ = cli("plan", "-p", pattern, "--with-optional", "--format", "sql", env=NAMES)
    assert too_wide(outside_function_bodies(out)) == []


@pytest.mark.newest_pg_only
def test_output_of_a_whole_migration_fits(dsn: str, tmp_path: Path) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn, SPEC)
        insert_rows(conn, SPEC.table, 20, spec=SPEC, published=True)
    env = {**NAMES, "OUTBOX_MIGRATE_DSN": dsn, "OUTBOX_MIGRATE_GATE_WINDOW_S": "0.2"}
    sequence = [
        ("ping",), ("plan", "-p", "hoper"), ("run", "-p", "hoper", "--to", "V2"), ("status",),
        ("roles",), ("verify",), ("rollback", "--to", "V1"), ("reset", "--yes"),
        ("run", "-p", "hoper", "--to", "V2"), ("next", "-p", "hoper"),
        ("run", "-p", "hoper", "--to", "V4"), ("status",), ("status", "--watch", "--count", "1"),
        ("copy-back",), ("status",), ("maintain", "--once"),
    ]  # fmt: skip
    for args in sequence:
        out, err = cli(*args, env=env)
        assert too_wide(out) == [], (args, too_wide(out))
        assert too_wide(err) == [], (args, too_wide(err))


def test_demo_report_keeps_every_word_whole(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo itself needs a minute of live load (test_demo_under_load); its report is
    rendered here from a report document at 80 columns."""
    from outbox_migrate.cli import console

    monkeypatch.setenv("COLUMNS", str(WIDTH))
    console.out.cache_clear()
    ids = [step.id for step in build_pattern("hoper", SPEC).steps()]
    report = {
        "pattern": "hoper", "rate_per_s": 500, "produced": 10, "published": 10, "lost": 0,
        "duplicated": 0, "max_insert_latency_ms": 12.5, "lock_timeout_ms": 200,
        "p99_insert_latency_ms": 3.1, "max_publish_gap_ms": 250.0, "max_publish_lag_ms": 300.0,
        "phases": [{"phase": "V1", "seconds": 5.0, "inserts": 2500, "max_insert_latency_ms": 9.0,
                    "p99_insert_latency_ms": 2.0}],
        "steps": [{"step": i, "outcome": "done", "duration_ms": 12.3, "attempts": 1,
                   "lock_wait_ms": 0.0, "max_insert_latency_ms_during": 4.2} for i in ids],
        "files": {"html": "reports/hoper-20261126-171500/report.html"},
    }  # fmt: skip
    try:
        console.render_demo_report(report)
    finally:
        console.out.cache_clear()
    printed = capsys.readouterr().out
    assert too_wide(printed) == []
    words = printed.split()
    for whole in ("outcome", "tries", "produced", "published", *ids):
        assert any(whole in word for word in words), whole
    for line in printed.splitlines():
        assert "outco" not in line or "outcome" in line


def test_rehearsal_report_fits(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rehearse` runs a whole pattern (tests/e2e/test_rehearse.py); the part of its report the
    demo's lacks — the source and the estimates at the real size — is rendered here at 80."""
    from outbox_migrate.cli import console

    monkeypatch.setenv("COLUMNS", str(WIDTH))
    console.out.cache_clear()
    report = {
        "pattern": "hoper", "rate_per_s": 20, "produced": 10, "published": 10, "lost": 0,
        "duplicated": 0, "max_insert_latency_ms": 12.5, "lock_timeout_ms": 200,
        "p99_insert_latency_ms": 3.1, "max_publish_gap_ms": 250.0, "max_publish_lag_ms": 300.0,
        "phases": [], "steps": [], "files": {},
        "source": {"table": "a_rather_long_schema_name.a_rather_long_outbox_table_name",
                   "server_version": "18.1 (Debian 18.1-1.pgdg120+1)", "row_estimate": 123456789,
                   "unpublished": 12, "heap_bytes": 98765432100, "measured_over_s": 5.0,
                   "inserts_per_s": 1234.5, "updates_per_s": 1230.1, "deletes_per_s": 0.0},
        "scratch": {"rows": 100000, "rate_per_s": 1000, "identity": "id",
                    "skipped": ["foreign key outbox_tenant_fkey (its target is not copied)"]},
        "extrapolated": [
            {"step": "hoper.v4.validate-check", "scratch_s": 0.058, "scale": 9.99,
             "fixed_s": 0.041, "scan_s": 0.2, "estimated_s": 0.2, "sure": False,
             "basis": "fixed cost + scan scaled by heap bytes; rough: the scratch scan took "
                      "under 0.2 s, give --rows more rows"},
            {"step": "copy-back", "scratch_rows": 207, "scratch_s": 0.255, "rows_per_s": 811.0,
             "estimated_s_per_hour_between_v2_and_swap": 5464.2, "basis": "rate"},
        ],
    }  # fmt: skip
    try:
        console.render_rehearsal_report(report)
    finally:
        console.out.cache_clear()
    printed = capsys.readouterr().out
    assert too_wide(printed) == []
    assert "hoper.v4.validate-check" in printed.split()
