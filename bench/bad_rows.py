"""Bad rows benchmark: what one bad row per 10,000 costs a draining relay, beside a clean run.

A bad row costs throughput only in the batches that hold it (docs/relay.md, "Bad rows"). Two
kinds, each drained against a clean outbox of the same shape, runs interleaved, median of
`--reps`:

  mark   after the swap: an id already in the published partition (the old table keeps its
         primary key), so the batch's mark fails and is repaired by bisection;
  claim  a jsonb headers value that is not a JSON object: found while the claimed rows become
         messages, no statement fails;
  bisect the mark kind without the conflict-key lookup (relay/mark_repair.py): the repair
         marks in halves, and a suspect is tried alone in a savepoint.

Each bad row is tried `--max-attempts` times (default 5), then dead-lettered (the mark kind also
removes it from the outbox). Printed: good rows drained per second, clean and with bad rows, and
the ratio (goal >= 90 %). The relay publishes through the stdout sink into /dev/null: claim,
messages, JSON envelopes, mark — no broker latency in the figures.

    PYTHONPATH=. python bench/bad_rows.py            # 100,000 rows, batch 500, 9 reps
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import psycopg
from outbox_migrate_harness.testing import server as pgserver

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay import mark_repair
from outbox_migrate.relay.options import RelayOptions
from outbox_migrate.relay.sinks.stdout import StdoutSink
from outbox_migrate.relay.worker import Relay

SPEC = OutboxSpec()
BAD_EVERY = 10_000
of_error = mark_repair.of_error


def create(conn: psycopg.Connection) -> None:
    """The swapped shape: a LIST-partitioned outbox whose DEFAULT partition is the old table,
    primary key included; a jsonb headers column for the claim kind."""
    conn.execute(
        "CREATE TABLE outbox_new (id bigint NOT NULL, event_type text, message_key text, "
        "payload jsonb NOT NULL, headers jsonb, created_at timestamptz NOT NULL DEFAULT now(), "
        "published_at timestamptz) PARTITION BY LIST (published_at)"
    )
    conn.execute("CREATE TABLE outbox_unpublished PARTITION OF outbox_new FOR VALUES IN (NULL)")
    conn.execute("CREATE INDEX ON outbox_unpublished (id)")
    conn.execute("CREATE TABLE outbox (LIKE outbox_new INCLUDING DEFAULTS, PRIMARY KEY (id))")
    conn.execute("ALTER TABLE outbox_new ATTACH PARTITION outbox DEFAULT")
    # Each drain leaves 100,000 dead rows behind: an autovacuum that starts in the middle of
    # one drain and not another moved single drains by ±30 %. `fill` vacuums instead.
    for table in ("outbox_unpublished", "outbox"):
        conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")


def fill(conn: psycopg.Connection, rows: int, kind: str, bad: bool) -> int:
    """`rows` unpublished rows; with `bad`, one in BAD_EVERY is bad. Returns the bad count.
    The published partition holds one row per BAD_EVERY either way (same shape): in the bad
    mark run their ids collide with unpublished ones."""
    conn.execute("TRUNCATE outbox_new, outbox_dead_letter, outbox_dead_letter_attempts")
    collide = bad and kind in {"mark", "bisect"}
    conn.execute(
        "INSERT INTO outbox_new (id, event_type, message_key, payload, headers, published_at) "
        "SELECT CASE WHEN %s THEN g ELSE -g END, 'e', 'k', '{}', '{}', now() "
        "FROM generate_series(%s::int8, %s::int8, %s::int8) g",
        (collide, BAD_EVERY // 2, rows, BAD_EVERY),
    )
    broken = bad and kind == "claim"
    conn.execute(
        "INSERT INTO outbox_new (id, event_type, message_key, payload, headers) "
        "SELECT g, 'event', 'k-' || g, jsonb_build_object('n', g, 'pad', repeat('x', 16)), "
        "CASE WHEN %s AND g %% %s::int8 = %s::int8 THEN '[1]'::jsonb ELSE '{\"a\": \"b\"}' END "
        "FROM generate_series(1, %s::int8) g",
        (broken, BAD_EVERY, BAD_EVERY // 2, rows),
    )
    conn.execute("VACUUM ANALYZE outbox_new")
    return rows // BAD_EVERY if bad else 0


def drain(dsn: str, batch: int, max_attempts: int) -> tuple[float, Relay]:
    devnull = Path(os.devnull).open("w")  # noqa: SIM115 - closed below
    try:
        relay = Relay(
            dsn,
            lambda: StdoutSink(stream=devnull),
            spec=SPEC,
            options=RelayOptions(
                batch_size=batch, until_empty=True, listen=False, max_attempts=max_attempts
            ),
        )
        started = time.perf_counter()
        relay.run()
        return time.perf_counter() - started, relay
    finally:
        devnull.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--max-attempts", type=int, default=5)
    parser.add_argument("--kinds", default="mark,claim,bisect")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    srv = pgserver.start(18)
    try:
        dsn = srv.dsn()
        print(f"PostgreSQL {srv.full_version}, {os.cpu_count()} CPUs, fsync off (throwaway); "
              f"{args.rows:,} rows, batch {args.batch}, 1 bad row per {BAD_EVERY:,}, "
              f"max attempts {args.max_attempts}, median of {args.reps}")  # fmt: skip
        with psycopg.connect(dsn, autocommit=True) as conn:
            create(conn)
            drain(dsn, args.batch, args.max_attempts)  # creates the dead-letter tables
            print(f"{'kind':<6} {'clean msg/s':>12} {'bad rows msg/s':>15} {'ratio':>7} "
                  f"{'dead-lettered':>14}")  # fmt: skip
            for kind in args.kinds.split(","):
                # `bisect`: as if no error named a key on the id alone.
                mark_repair.of_error = (lambda *_: None) if kind == "bisect" else of_error
                rates: dict[bool, list[float]] = {False: [], True: []}
                dead = 0
                for _ in range(args.reps):
                    for bad in (False, True):  # interleaved: drift hits both alike
                        expected_bad = fill(conn, args.rows, kind, bad)
                        secs, relay = drain(dsn, args.batch, args.max_attempts)
                        good = args.rows - expected_bad
                        assert relay.stats.published == good, relay.stats.as_dict()
                        assert relay.stats.dead_lettered == expected_bad
                        rates[bad].append(good / secs)
                        dead = relay.stats.dead_lettered if bad else dead
                clean, with_bad = statistics.median(rates[False]), statistics.median(rates[True])
                print(f"{kind:<6} {clean:>12,.0f} {with_bad:>15,.0f} "
                      f"{with_bad / clean:>7.1%} {dead:>14}")  # fmt: skip
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
