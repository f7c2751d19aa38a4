"""Poison under key ordering: how long a message every attempt refuses takes to be
dead-lettered with `--ordering key`, beside `--ordering none`, on the same machine in one run.

With `--ordering none` a refused message pauses its worker for the backoff and is claimed again
from its id; with `--ordering key` it parks its key (relay/parking.py) and the worker's cursor
claims from just below it when its next attempt is due. The goal (issue 34): key ordering
dead-letters it within max(3 s, 3 x the time `none` takes).

Each rep, for each ordering in turn (interleaved, so drift hits both alike): a backlog of
`--rows` rows over 1,000 keys, a snapshot held by another session (as a long report would;
the drain's dead index entries stay, so a claim from id 0 walks all of them — the load under
which the key-shard rescan is spaced out), a writer adding `--rate` rows/s, and after
`--poison-after` s the poison: a message over `--max-message-bytes`, which the stdout sink
(into /dev/null) refuses on every attempt. Measured: the poison's `dead_at - created_at`.
Defaults: 5 attempts, the relay's default backoff (0.1 s doubling, cap 8 s).

    PYTHONPATH=. python bench/poison_order.py           # 50,000-row backlog, 5 reps, ~1 min
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import psycopg
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import create_partitioned_outbox

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.options import Ordering, RelayOptions
from outbox_migrate.relay.sinks import SinkConfig
from outbox_migrate.relay.sinks.stdout import StdoutSink
from outbox_migrate.relay.worker import Relay, running

SPEC = OutboxSpec()
KEYS = 1_000
MAX_MESSAGE_BYTES = 2_000
TIMEOUT_S = 90.0


def fill(conn: psycopg.Connection, rows: int) -> None:
    conn.execute("TRUNCATE outbox_new, outbox_dead_letter, outbox_dead_letter_attempts")
    conn.execute(
        "INSERT INTO outbox_new (event_type, message_key, payload) "
        "SELECT 'event', 'k-' || (g %% %s), jsonb_build_object('n', g) "
        "FROM generate_series(1, %s) g",
        (KEYS, rows),
    )
    conn.execute("VACUUM ANALYZE outbox_new")


def write(dsn: str, rate: int, stop: threading.Event) -> None:
    """The application: `rate` rows a second, in statements of rate/100 rows every 10 ms."""
    per = max(1, rate // 100)
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            conn.execute(
                "INSERT INTO outbox_new (event_type, message_key, payload) "
                "SELECT 'event', 'k-' || (random() * %s)::int, '{}' FROM generate_series(1, %s)",
                (KEYS, per),
            )
            stop.wait(0.01)


def one_run(dsn: str, ordering: Ordering, args: argparse.Namespace) -> float:
    """Seconds from the poison's insert to its dead letter."""
    devnull = Path(os.devnull).open("w")  # noqa: SIM115 - closed below
    config = SinkConfig(max_message_bytes=MAX_MESSAGE_BYTES)
    relay = Relay(
        dsn,
        lambda: StdoutSink(config, stream=devnull),
        spec=SPEC,
        options=RelayOptions(
            ordering=ordering, batch_size=args.batch, listen=False,
            max_attempts=args.max_attempts, max_message_bytes=MAX_MESSAGE_BYTES,
        ),
    )  # fmt: skip
    stop = threading.Event()
    writer = threading.Thread(target=write, args=(dsn, args.rate, stop), daemon=True)
    report = psycopg.connect(dsn)
    try:
        if args.hold_xmin:
            report.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            report.execute("SELECT count(*) FROM outbox_new")
        with psycopg.connect(dsn, autocommit=True) as conn, running(relay):
            writer.start()
            time.sleep(args.poison_after)
            conn.execute(
                "INSERT INTO outbox_new (event_type, message_key, payload) "
                "VALUES ('poison', 'k-7', jsonb_build_object('pad', repeat('x', %s)))",
                (2 * MAX_MESSAGE_BYTES,),
            )
            deadline = time.monotonic() + TIMEOUT_S
            row = None
            while row is None and time.monotonic() < deadline:
                time.sleep(0.05)
                row = conn.execute(
                    "SELECT extract(epoch FROM dead_at - created_at) FROM outbox_dead_letter"
                ).fetchone()
            stop.set()
            writer.join(10)
        if row is None:
            return TIMEOUT_S
        return float(row[0])
    finally:
        stop.set()
        report.close()
        devnull.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000, help="backlog at start")
    parser.add_argument("--rate", type=int, default=2_000, help="rows/s written meanwhile")
    parser.add_argument("--poison-after", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-attempts", type=int, default=5)
    parser.add_argument("--hold-xmin", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    logging.getLogger("outbox_migrate").setLevel(logging.ERROR)  # a line per attempt otherwise
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    srv = pgserver.start(18)
    try:
        dsn = srv.dsn()
        print(f"PostgreSQL {srv.full_version}, {os.cpu_count()} CPUs, fsync off (throwaway); "
              f"backlog {args.rows:,} rows, {args.rate:,} rows/s written, batch {args.batch}, "
              f"max attempts {args.max_attempts}, snapshot held: {args.hold_xmin}; "
              f"median of {args.reps}")  # fmt: skip
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_partitioned_outbox(conn, SPEC)
            relay = Relay(dsn, lambda: StdoutSink(stream=sys.stderr), spec=SPEC,
                          options=RelayOptions(until_empty=True, listen=False))  # fmt: skip
            relay.run()  # creates the dead-letter tables
            times: dict[Ordering, list[float]] = {Ordering.none: [], Ordering.key: []}
            for _ in range(args.reps):
                for ordering, runs in times.items():
                    fill(conn, args.rows)
                    runs.append(one_run(dsn, ordering, args))
        none, key = (statistics.median(times[o]) for o in (Ordering.none, Ordering.key))
        for ordering, runs in times.items():
            shown = ", ".join(f"{t:.2f}" for t in runs)
            print(f"--ordering {ordering.value:<5} poison dead-lettered after (s): {shown}")
        goal = max(3.0, 3 * none)
        print(f"median: none {none:.2f} s, key {key:.2f} s, key/none {key / none:.1f}x; "
              f"goal key <= max(3 s, 3 x none) = {goal:.2f} s: "
              f"{'met' if key <= goal else 'NOT met'}")  # fmt: skip
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
