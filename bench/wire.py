"""The relay's hot path through psycopg's pipeline vs through `psycopg.pq` (relay/wire.py).

One cycle is what a steady-state batch costs the relay's session: BEGIN, claim (5 rows),
Sync, read; mark, COMMIT, Sync, read. Printed: CPU µs per cycle of this process (user +
system) and wall µs, back to back and with 5 ms between cycles (a lingering relay), both
drivers interleaved in one run on a throwaway PostgreSQL 18 (fsync off).

    python bench/wire.py [--cycles 3000 --rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import psycopg
from outbox_migrate_harness.testing import server as pgserver

from outbox_migrate.relay.wire import Wire

CLAIM = (
    b"SELECT id, payload, ctid::text FROM bench_wire WHERE published_at IS NULL "
    b"AND id > %(after)s ORDER BY id LIMIT 500 FOR UPDATE"
)
MARK = b"UPDATE bench_wire SET payload = payload WHERE ctid = ANY(%(tids)s::tid[])"
TIDS = '{"(0,1)","(0,2)","(0,3)","(0,4)","(0,5)"}'


def psycopg_cycles(conn: psycopg.Connection, cycles: int, pause_s: float) -> None:
    with conn.pipeline() as pipeline:
        for _ in range(cycles):
            conn.execute(b"BEGIN")
            claimed = conn.execute(CLAIM, {"after": 0}, prepare=True)
            pipeline.sync()
            claimed.fetchall()
            conn.execute(MARK, {"tids": TIDS}, prepare=True)
            conn.execute(b"COMMIT")
            pipeline.sync()
            if pause_s:
                time.sleep(pause_s)


def wire_cycles(conn: psycopg.Connection, cycles: int, pause_s: float) -> None:
    wire = Wire(conn)
    with wire.pipeline():
        for _ in range(cycles):
            wire.send_plain(b"BEGIN")
            claimed = wire.send(CLAIM, {"after": 0})
            wire.sync()
            wire.rows(claimed)
            wire.send(MARK, {"tids": TIDS})
            wire.send_plain(b"COMMIT")
            wire.sync()
            if pause_s:
                time.sleep(pause_s)


def measure(
    dsn: str, run: Callable[[psycopg.Connection, int, float], None], cycles: int, pause_s: float
) -> tuple[float, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.prepare_threshold = None  # psycopg's pipeline prepares what says prepare=True
        run(conn, 50, 0.0)  # warm up: plans, caches
        cpu, wall = time.process_time(), time.perf_counter()
        run(conn, cycles, pause_s)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return 1e6 * cpu / cycles, 1e6 * (wall - cycles * pause_s) / cycles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    args = parser.parse_args()
    srv = pgserver.start(18)
    try:
        dsn = srv.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE bench_wire (id bigint PRIMARY KEY, payload text, "
                "published_at timestamptz)"
            )
            conn.execute("INSERT INTO bench_wire SELECT g, 'x', NULL FROM generate_series(1, 5) g")
        print(f"PostgreSQL {srv.full_version}; {args.cycles} cycles each; µs per cycle, "
              f"median of {args.rounds} interleaved rounds")  # fmt: skip
        print(f"{'pause':>6} {'driver':>16} {'CPU':>7} {'wall':>7}")
        drivers = (("psycopg pipeline", psycopg_cycles), ("relay/wire.py", wire_cycles))
        for pause_s in (0.0, 0.005):
            cycles = args.cycles if not pause_s else max(1, args.cycles // 3)
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in drivers}
            for _ in range(args.rounds):
                for name, run in drivers:
                    runs[name].append(measure(dsn, run, cycles, pause_s))
            for name, _ in drivers:
                cpu = statistics.median(r[0] for r in runs[name])
                wall = statistics.median(r[1] for r in runs[name])
                print(f"{pause_s * 1000:>4.0f}ms {name:>16} {cpu:>7.0f} {wall:>7.0f}")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
