"""`rehearse`: the whole migration on a copy of the user's outbox, under its measured load
(docs/cli.md, "Rehearse on a copy"). Must never write to the source."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import harness_missing
from outbox_migrate.rehearse.source import SourceShape

RATE_FLOOR_PER_S = 20
RATE_CEILING_PER_S = 1_000
"""The scratch load's insert rate is the measured one, kept within these bounds: below the
floor a short rehearsal sees too few rows per phase, above the ceiling one machine's
writers and relays measure themselves more than the migration."""
SCAN_STEPS = ("validate-check",)
"""Steps whose time grows with the old table's size (a full scan under SHARE UPDATE
EXCLUSIVE): extrapolated by the ratio of heap sizes."""


@dataclass(frozen=True)
class RehearsalRequest:
    pattern: str
    source_dsn: str
    scratch_dsn: str
    recording_dsn: str
    spec: OutboxSpec
    rows: int = 100_000
    seconds: float = 40.0
    measure_s: float = 5.0
    sample: bool = False


def rehearse(
    request: RehearsalRequest,
    *,
    shape: SourceShape,
    on_snapshot: Callable[[Any], None] | None = None,
    output_dir: Path | None = None,
) -> dict[str, Any]:
    """Measure, rebuild, run; the demo's report plus `source`, `scratch` and `extrapolated`.
    `shape` is read first (`check_source`), so a refused source leaves the scratch server alone."""
    from outbox_migrate.rehearse import scratch
    from outbox_migrate.rehearse.source import measure_rates, read_only_connect

    try:
        from outbox_migrate_harness.sim import simulate
        from outbox_migrate_harness.sim.scenario import Scenario
    except ModuleNotFoundError as exc:
        raise harness_missing("rehearse", exc) from None

    spec = request.spec
    rates = measure_rates(request.source_dsn, spec, request.measure_s)
    insert_sql, identity = scratch.insert_statement(shape, spec)
    rate = round(min(max(rates.inserts_per_s, RATE_FLOOR_PER_S), RATE_CEILING_PER_S))
    rebuilt = scratch.Rebuilt()

    def prepare(dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            rebuilt.skipped = scratch.rebuild(conn, shape, spec).skipped
            if request.sample:
                with read_only_connect(request.source_dsn) as source:
                    rebuilt.rows = scratch.fill_sample(source, conn, shape, spec, request.rows)
            else:
                rebuilt.rows = scratch.fill_synthetic(conn, shape, spec, request.rows)
            rebuilt.heap_bytes, rebuilt.scan_s = _measure_scan(conn, spec)

    scenario = Scenario(
        request.pattern,
        rate_per_s=rate,
        duration_s=request.seconds,
        spec=spec,
        insert_sql=insert_sql,
        identity=identity,
    )
    report = simulate(
        request.scratch_dsn,
        request.recording_dsn,
        scenario,
        on_snapshot=on_snapshot,
        output_dir=output_dir,
        prepare=prepare,
    )
    facts = shape.facts
    report["source"] = {
        "table": f"{spec.schema}.{spec.table}",
        "server_version": facts.server_version_text,
        "row_estimate": facts.row_estimate,
        "unpublished": facts.unpublished,
        "heap_bytes": facts.heap_bytes,
        "total_bytes": facts.total_bytes,
        **asdict(rates),
    }
    report["scratch"] = {
        "rows": rebuilt.rows,
        "rate_per_s": rate,
        "identity": identity,
        "skipped": rebuilt.skipped,
        "heap_bytes": rebuilt.heap_bytes,
        "scan_s": round(rebuilt.scan_s, 4),
    }
    report["extrapolated"] = extrapolate(report, request.scratch_dsn)
    return report


def check_source(source_dsn: str, spec: OutboxSpec, pattern: str) -> SourceShape:
    """The source's shape, read only; refused (`SchemaError`, blockers) as `plan` would."""
    from outbox_migrate.advisory.introspect import raise_for_blockers
    from outbox_migrate.rehearse.source import read_shape

    shape = read_shape(source_dsn, spec, pattern)
    raise_for_blockers(shape.facts)
    return shape


SURE_SCAN_S = 0.2
"""A scratch scan shorter than this is mostly timer and cache noise: its per-byte rate (and
so an estimate scaled from it) is reported as a rough one."""


def _measure_scan(conn: psycopg.Connection[Any], spec: OutboxSpec) -> tuple[int, float]:
    """The filled old table's heap before the run (what the run's scan steps read, plus the
    few seconds of rows the writers add), and the best of three full sequential reads of it:
    a scan step's per-byte cost on this server, apart from the step's fixed cost (connecting,
    checks, catalog reads, the commit), which the size of the table does not change."""
    table = sql.Identifier(spec.schema, spec.table)
    row = conn.execute(
        "SELECT coalesce(pg_relation_size(to_regclass(%s)), 0)", (table.as_string(conn),)
    ).fetchone()
    conn.execute("SET max_parallel_workers_per_gather = 0")  # VALIDATE scans alone
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table))
        best = min(best, time.perf_counter() - started)
    return (int(row[0]) if row else 0), best


def extrapolate(report: dict[str, Any], scratch_dsn: str) -> list[dict[str, Any]]:
    """How long the size-bound steps would take on the source (docs/cli.md, "Rehearse on a
    copy"). The fixed part is kept apart from the scan: a small copy's step time is almost all
    fixed cost, and scaling it whole would overstate the scan."""
    from outbox_migrate.jobs.common import STATE_SCHEMA, Relation, exists
    from outbox_migrate.jobs.copy_back import PROGRESS_TABLE

    out = scan_estimates(report)
    progress = Relation(STATE_SCHEMA, PROGRESS_TABLE)  # copy-back's (HOPER's) progress table
    with psycopg.connect(scratch_dsn, autocommit=True) as conn:
        row = (
            exists(conn, progress)
            and conn.execute(
                sql.SQL(
                    "SELECT sum(rows_inserted), extract(epoch FROM max(coalesce(copied_at, "
                    "updated_at)) - min(started_at)) FROM {}"
                ).format(progress.ident)
            ).fetchone()
        )
    if row and row[0] is not None:
        rows, seconds = int(row[0]), float(row[1] or 0.0)
        rate = rows / seconds if seconds > 0 else 0.0
        per_hour = float(report["source"]["updates_per_s"]) * 3600
        out.append({
            "step": "copy-back",
            "scratch_rows": rows,
            "scratch_s": round(seconds, 3),
            "rows_per_s": round(rate, 1),
            "estimated_s_per_hour_between_v2_and_swap": (
                round(per_hour / rate, 1) if rate > 0 else None
            ),
            "basis": "rows published per hour at the measured update rate, copied at the "
            "scratch rate",
        })  # fmt: skip
    return out


def scan_estimates(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The scan steps' part of `extrapolate`: pure, from the report alone."""
    source, copy = report["source"], report["scratch"]
    out: list[dict[str, Any]] = []
    scratch_bytes = max(int(copy["heap_bytes"]), 1)
    scan_s = float(copy.get("scan_s") or 0.0)
    for step in report.get("steps", []):
        if not any(step["step"].endswith(kind) for kind in SCAN_STEPS):
            continue
        seconds = max(step["duration_ms"] - step["lock_wait_ms"], 0) / 1000
        factor = max(int(source["heap_bytes"]), 0) / scratch_bytes
        scan = min(scan_s, seconds)
        fixed = seconds - scan
        sure = scan_s >= SURE_SCAN_S
        out.append(
            {
                "step": step["step"],
                "scratch_s": round(seconds, 3),
                "scale": round(factor, 2),
                "fixed_s": round(fixed, 3),
                "scan_s": round(scan * factor, 1),
                "estimated_s": round(fixed + scan * factor, 1),
                "sure": sure,
                "basis": "fixed cost + scan scaled by heap bytes"
                + ("" if sure else f"; rough: the scratch scan took under {SURE_SCAN_S} s, "
                   "give --rows more rows"),
            }
        )  # fmt: skip
    return out
