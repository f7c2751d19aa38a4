"""Soak: every pattern under sustained live load, longer and harder than the CI-sized proof.

    python bench/soak.py                         # 5 patterns x 300 s at 1000 inserts/s
    python bench/soak.py --patterns hopia --duration 900 --rate 2000 --pg 16

Starts its own throwaway PostgreSQL, runs the proof harness (outbox_migrate_harness.sim) per pattern
and prints one line per pattern: produced, lost, duplicated, worst insert stall, longest
publish gap, pause. Exit status 1 if anything was lost, or if a hot pattern stalled inserts
beyond lock_timeout + 100 ms or paused publication for more than 2 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import psycopg
from outbox_migrate_harness.sim import simulate
from outbox_migrate_harness.sim.scenario import Scenario
from outbox_migrate_harness.testing import server as pgserver
from psycopg import sql

from outbox_migrate.patterns import PATTERN_NAMES

HOT = {"hop", "hoper", "hopia"}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--patterns", default=",".join(PATTERN_NAMES))
    parser.add_argument("--duration", type=float, default=300.0, help="seconds per pattern")
    parser.add_argument("--rate", type=int, default=1000, help="inserts per second")
    parser.add_argument("--pg", type=int, default=pgserver.DEFAULT_VERSION)
    parser.add_argument("--format", choices=["text", "json"], default="text")
    args = parser.parse_args()
    server = pgserver.start(args.pg)
    results = []
    failed = False
    try:
        for pattern in args.patterns.split(","):
            with psycopg.connect(server.dsn(), autocommit=True) as conn:
                for name in ("soak", "soak_rec"):
                    conn.execute(
                        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                            sql.Identifier(name)
                        )
                    )
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            report = simulate(
                server.dsn("soak"),
                server.dsn("soak_rec"),
                Scenario(pattern, rate_per_s=args.rate, duration_s=args.duration),
                output_dir=Path(tempfile.gettempdir()) / "outbox-migrate-soak",
            )
            ok = report["lost"] == 0 and report["backlog_left"] == 0
            if pattern in HOT:
                ok = ok and report["max_insert_latency_ms"] <= report["lock_timeout_ms"] + 100
                ok = ok and report["max_publish_gap_ms"] <= 2000
            failed = failed or not ok
            row = {
                k: report.get(k)
                for k in (
                    "pattern",
                    "produced",
                    "lost",
                    "duplicated",
                    "max_insert_latency_ms",
                    "p99_insert_latency_ms",
                    "max_publish_gap_ms",
                    "pause_ms",
                )
            }
            row["ok"] = ok
            results.append(row)
            if args.format == "text":
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    finally:
        server.stop()
    if args.format == "json":
        print(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
