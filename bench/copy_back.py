"""Benchmark HOPER's copy-back against the SQL-only limit, and its effect on the foreground.

Starts its own PostgreSQL 18 (`outbox_migrate_harness.testing.server.start(18)`), and for each size
builds the post-V4 state once as a template database, then clones it for every measurement
so each run starts from identical data:

- `sql-limit`: a server-side keyset loop of INSERT … SELECT … ORDER BY id LIMIT 10000
  ON CONFLICT DO NOTHING with a COMMIT per batch — the fastest this copy can be in SQL;
- `copy-back`: `CopyBack.run()` unthrottled (no rate, no back-off), then `verify()`;
- foreground: a separate process inserting single outbox rows at a fixed pace, its latency
  p50/p99 without any copy, during the unthrottled copy, and during the throttled copy
  (probe back-off on).

Usage: python bench/copy_back.py [--big] [--sizes 100000,1000000] [--pg 18]
(`--big` adds 10 M rows.) Figures are ratios taken side by side in one run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
import uuid
from typing import Any

import psycopg
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import build_after_v4
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.jobs.copy_back import CopyBack, CopyBackOptions
from outbox_migrate.jobs.throttle import ThrottlePolicy

BATCH_ROWS = 10_000
FOREGROUND_PACE_PER_S = 500
"""Foreground single-row inserts per second (open loop: paced, not back-to-back)."""
BASELINE_S = 3.0
RATE_CAP_ROWS_PER_S = 100_000.0
"""The `--rate` of the third foreground run (probe back-off plus a ceiling)."""

SQL_LIMIT = """
DO $$
DECLARE
    hw bigint := -9223372036854775808;
    n bigint;
BEGIN
    LOOP
        WITH ins AS (
            INSERT INTO public.outbox OVERRIDING SYSTEM VALUE
            SELECT * FROM public.outbox_published WHERE id > hw ORDER BY id LIMIT 10000
            ON CONFLICT (id) DO NOTHING RETURNING id
        )
        SELECT max(id), count(*) INTO hw, n FROM ins;
        EXIT WHEN n = 0;
        COMMIT;
    END LOOP;
END $$;
"""


def build_template(srv: pgserver.Server, rows: int) -> str:
    """Post-V4 state with `rows` rows in the detached source, plus its keyset index."""
    name = f"bench_{rows}"
    with psycopg.connect(srv.dsn(), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    with psycopg.connect(srv.dsn(name), autocommit=True) as conn:
        build_after_v4(conn, old_rows=10_000, published_rows=1_000)
        # The rest of the source directly (publishing N rows through the partitioned table
        # would only double the setup time): same columns, ids above, narrow rows.
        conn.execute(
            "INSERT INTO outbox_published"
            " (id, event_type, message_key, payload, created_at, published_at)"
            " OVERRIDING SYSTEM VALUE"
            " SELECT m.top + g, 'event', 'k-' || g, json_build_object('n', g), now(), now()"
            " FROM (SELECT max(id) AS top FROM outbox_published) m,"
            " generate_series(1, %s) g",
            (rows - 1_000,),
        )
        started = time.monotonic()
        job = CopyBack(conn, OutboxSpec())
        job.ensure_source_index()  # timed apart: same for both runs
        index_s = time.monotonic() - started
        conn.execute("VACUUM (ANALYZE) outbox_published")
        conn.execute("VACUUM (ANALYZE) outbox")
        conn.execute("CHECKPOINT")
    print(f"  template {name}: {rows:,} source rows; keyset index built in {index_s:.2f}s")
    return name


def clone(srv: pgserver.Server, template: str) -> str:
    name = f"run_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(srv.dsn(), autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
        admin.execute("CHECKPOINT")
    return name


def drop(srv: pgserver.Server, name: str) -> None:
    with psycopg.connect(srv.dsn(), autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def run_sql_limit(srv: pgserver.Server, template: str, rows: int) -> float:
    db = clone(srv, template)
    try:
        with psycopg.connect(srv.dsn(db), autocommit=True) as conn:
            started = time.monotonic()
            conn.execute(SQL_LIMIT)
            elapsed = time.monotonic() - started
            copied = conn.execute(
                "SELECT count(*) FROM outbox WHERE id IN (SELECT id FROM outbox_published)"
            ).fetchone()[0]  # type: ignore[index]
        assert copied == rows, (copied, rows)
        return rows / elapsed
    finally:
        drop(srv, db)


def foreground(dsn: str, stop: Any, pace: float, out: Any) -> None:
    """A paced single-row writer until `stop` is set: (wall-clock start, latency s) each."""
    samples = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox_new (payload) VALUES ('{}')")
        interval = 1.0 / pace
        next_at = time.time()
        while not stop.is_set():
            now = time.time()
            if now < next_at:
                time.sleep(next_at - now)
            start = time.time()
            conn.execute("INSERT INTO outbox_new (payload) VALUES ('{\"fg\": 1}')")
            samples.append((start, time.time() - start))
            next_at += interval
    out.send(samples)
    out.close()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000.0 if ordered else 0.0


def run_copy_back(
    srv: pgserver.Server, template: str, rows: int, policy: ThrottlePolicy
) -> dict[str, float]:
    db = clone(srv, template)
    dsn = srv.dsn(db)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            options = CopyBackOptions(BATCH_ROWS, throttle=policy)
            job = CopyBack(conn, OutboxSpec(), options, dsn=dsn)
            t0 = time.monotonic()
            result = job.run()
            t1 = time.monotonic()
            verification = job.verify()
            verify_s = time.monotonic() - t1
        assert verification.passed and result.inserted_rows == rows
        return {"rows_per_s": rows / (t1 - t0), "verify_s": verify_s}
    finally:
        drop(srv, db)


def run_with_foreground(
    srv: pgserver.Server, template: str, rows: int, policy: ThrottlePolicy
) -> dict[str, Any]:
    """Baseline, then the copy, with one paced writer across both; latencies split by time."""
    db = clone(srv, template)
    dsn = srv.dsn(db)
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    proc = ctx.Process(target=foreground, args=(dsn, stop, FOREGROUND_PACE_PER_S, writer))
    proc.start()
    try:
        time.sleep(1.0 + BASELINE_S)
        with psycopg.connect(dsn, autocommit=True) as conn:
            options = CopyBackOptions(BATCH_ROWS, throttle=policy)
            job = CopyBack(conn, OutboxSpec(), options, dsn=dsn)
            t0 = time.time()
            result = job.run()
            t1 = time.time()
        stop.set()
        if not reader.poll(60):
            raise RuntimeError("the foreground writer died without reporting")
        samples: list[tuple[float, float]] = reader.recv()
        proc.join()
        base = [lat for t, lat in samples if t < t0 and t > t0 - BASELINE_S]
        during = [lat for t, lat in samples if t0 <= t <= t1]
        return {
            "rows_per_s": result.inserted_rows / (t1 - t0),
            "paused_s": result.paused_s,
            "base_p50": pct(base, 0.5),
            "base_p99": pct(base, 0.99),
            "p50": pct(during, 0.5),
            "p99": pct(during, 0.99),
            "n": len(during),
        }
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join()
        drop(srv, db)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="add the 10 M row size")
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--pg", type=int, default=18)
    parser.add_argument("--no-foreground", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.big:
        sizes.append(10_000_000)
    srv = pgserver.start(args.pg)
    try:
        load = os.getloadavg()[0]
        print(f"PostgreSQL {srv.full_version}; batch {BATCH_ROWS:,} rows; {os.cpu_count()} CPUs;"
              f" load average {load:.1f} (other work on the machine skews figures)")  # fmt: skip
        unthrottled = ThrottlePolicy(adaptive=False)
        throttled = ThrottlePolicy(adaptive=True)
        capped = ThrottlePolicy(adaptive=True, rate_rows_per_s=RATE_CAP_ROWS_PER_S)
        rates: dict[int, float] = {}
        for rows in sizes:
            print(f"\n== {rows:,} rows")
            template = build_template(srv, rows)
            limit = statistics.median(run_sql_limit(srv, template, rows) for _ in range(2))
            ours = [run_copy_back(srv, template, rows, unthrottled) for _ in range(2)]
            rate = statistics.median(r["rows_per_s"] for r in ours)
            rates[rows] = rate
            print(f"  sql-limit  : {limit:>12,.0f} rows/s")
            print(f"  copy-back  : {rate:>12,.0f} rows/s  = {100 * rate / limit:.0f} % of the "
                  f"SQL limit; verify {ours[0]['verify_s']:.2f}s "
                  f"({rows / ours[0]['verify_s']:,.0f} rows/s)")  # fmt: skip
            if not args.no_foreground:
                fast = run_with_foreground(srv, template, rows, unthrottled)
                slow = run_with_foreground(srv, template, rows, throttled)
                cap = run_with_foreground(srv, template, rows, capped)
                runs = (("unthrottled", fast), ("adaptive", slow), ("adaptive+100k/s", cap))
                for label, r in runs:
                    print(
                        f"  foreground inserts ({FOREGROUND_PACE_PER_S}/s), {label:<15}: "
                        f"without copy p50 {r['base_p50']:.2f} ms p99 {r['base_p99']:.2f} ms | "
                        f"during copy p50 {r['p50']:.2f} ms p99 {r['p99']:.2f} ms "
                        f"({r['p99'] / r['base_p99']:.2f}x p99; copy {r['rows_per_s']:,.0f} "
                        f"rows/s, paused {r['paused_s']:.1f}s, n={r['n']})"
                    )
            drop(srv, template)
        if len(rates) > 1:
            small, large = min(rates), max(rates)
            print(f"load average at the end {os.getloadavg()[0]:.1f}")
            print(f"\nrate at {large:,} = {100 * rates[large] / rates[small]:.0f} % of the rate "
                  f"at {small:,}")  # fmt: skip
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
