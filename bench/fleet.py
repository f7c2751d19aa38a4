"""Fleet scaling: N relay processes on one outbox, side by side in one run.

For N = 1, 2, 4 relay processes (one worker each, shards balanced through the advisory-lock
leases, the fleet's defaults for dead-session detection and fencing), with and without a 5 ms
broker acknowledgement per batch: rows are inserted at once into the running, balanced fleet
and timed until the unpublished partition is empty. Besides messages/s it reads the CPU time
the relay processes and the PostgreSQL server processes spent (from /proc), so the figures say
where the time goes: CPU per message on each side, and how many of the machine's cores were
busy. The sink is stdout into /dev/null plus the optional acknowledgement wait: the relay's and
the database's own cost, no broker's.

    python bench/fleet.py                 # about 2 minutes
    python bench/fleet.py --rows 100000 --reps 3 --batch 100
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import create_partitioned_outbox, insert_rows

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.options import RelayOptions
from outbox_migrate.relay.sinks.stdout import StdoutSink
from outbox_migrate.relay.worker import Relay, running

SPEC = OutboxSpec()
SHARDS = 8
BALANCE_WAIT_S = 3.0
"""Time for a freshly started fleet to settle on fair shares (rebalance every 1 s)."""
POLL_S = 0.002
"""The relay processes' poll interval, and their linger (which may not exceed it)."""
ACK_S = 0.005
TICKS = os.sysconf("SC_CLK_TCK")


class AckSink(StdoutSink):
    """The stdout sink plus a fixed wait per batch, like a broker's acknowledgement."""

    def __init__(self, stream: Any, ack_s: float) -> None:
        super().__init__(stream=stream)
        self.ack_s = ack_s

    def publish(self, batch: Any) -> None:
        super().publish(batch)
        if self.ack_s:
            time.sleep(self.ack_s)


def _relay(dsn: str, batch: int, ack_s: float, ready: Any, stop: Any) -> None:
    with Path(os.devnull).open("w") as devnull:
        relay = Relay(
            dsn,
            lambda: AckSink(devnull, ack_s),
            spec=SPEC,
            # The linger must fit in the poll interval (RelayOptions refuses it otherwise):
            # the default 5 ms linger with a 2 ms poll made every child fail at start.
            options=RelayOptions(
                batch_size=batch, shards=SHARDS, listen=False,
                poll_interval_s=POLL_S, linger_s=POLL_S,
            ),
        )  # fmt: skip
        with running(relay):
            ready.set()
            stop.wait()


def cpu_s(pids: list[int]) -> float:
    """utime + stime of the given processes, seconds."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


def server_pids(data_dir: Path) -> list[int]:
    """The postmaster and every process it started (backends, walwriter, …)."""
    postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    pids = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == postmaster:
                pids.append(int(entry.name))
    return pids


def run_once(
    dsn: str, data_dir: Path, conn: psycopg.Connection, rows: int, batch: int, n: int, ack_s: float
) -> tuple[float, float, float]:
    """(messages/s, relay CPU µs per message, PostgreSQL CPU µs per message)."""
    conn.execute("TRUNCATE outbox_new")
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    readies = [ctx.Event() for _ in range(n)]
    children = [ctx.Process(target=_relay, args=(dsn, batch, ack_s, r, stop)) for r in readies]
    for child in children:
        child.start()
    try:
        deadline = time.monotonic() + 60
        while not all(ready.is_set() for ready in readies):
            # A child that died at start (its traceback is on stderr) would leave the drain
            # loop below waiting for ever.
            dead = [c.exitcode for c in children if not c.is_alive()]
            if dead or time.monotonic() > deadline:
                raise SystemExit(f"relay processes did not start: exit codes {dead}")
            time.sleep(0.05)
        time.sleep(BALANCE_WAIT_S)
        insert_rows(conn, "outbox_new", rows, spec=SPEC)
        relay_pids = [c.pid for c in children if c.pid is not None]
        pg_pids = server_pids(data_dir)
        relay_before, pg_before = cpu_s(relay_pids), cpu_s(pg_pids)
        started = time.perf_counter()
        while conn.execute("SELECT 1 FROM outbox_unpublished LIMIT 1").fetchone():
            time.sleep(0.005)
        secs = time.perf_counter() - started
        relay_cpu = cpu_s(relay_pids) - relay_before
        pg_cpu = cpu_s(server_pids(data_dir)) - pg_before
    finally:
        stop.set()
        for child in children:
            child.join(30)
    return rows / secs, relay_cpu / rows * 1e6, pg_cpu / rows * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--reps", type=int, default=2, help="runs per figure (median)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    started = time.perf_counter()
    srv = pgserver.start(18)
    try:
        assert srv.data_dir is not None
        dsn = srv.dsn()
        print(f"PostgreSQL {srv.full_version}, {os.cpu_count()} CPUs, fsync off (throwaway)")
        print(f"\n## Relay processes on one outbox: {args.rows:,} rows, batch {args.batch}, "
              f"{SHARDS} shards, median of {args.reps}")  # fmt: skip
        print(f"{'ack':>5} {'procs':>5} {'msg/s':>9} {'vs 1':>6} {'relay µs/msg':>13} "
              f"{'PG µs/msg':>10} {'cores busy':>11}")  # fmt: skip
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_partitioned_outbox(conn, SPEC, start=1)
            for ack_s in (0.0, ACK_S):
                base = 0.0
                for n in (1, 2, 4):
                    runs = [run_once(dsn, srv.data_dir, conn, args.rows, args.batch, n, ack_s)
                            for _ in range(args.reps)]  # fmt: skip
                    rate = statistics.median(r[0] for r in runs)
                    relay_us = statistics.median(r[1] for r in runs)
                    pg_us = statistics.median(r[2] for r in runs)
                    base = base or rate
                    busy = rate * (relay_us + pg_us) / 1e6
                    print(f"{ack_s * 1000:>3.0f}ms {n:>5} {rate:>9,.0f} {rate / base:>5.2f}x "
                          f"{relay_us:>13.1f} {pg_us:>10.1f} {busy:>11.2f}")  # fmt: skip
        print(
            "(cores busy = messages/s * CPU per message of relays + PostgreSQL; the machine "
            f"has {os.cpu_count()})"
        )
    finally:
        srv.stop()
    print(f"(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
