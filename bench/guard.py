"""Unpublished-row guard benchmark: what the guard (patterns/kinds/guard.py) costs the
publishers that drain the outbox and a framework's cleanup, with and without it, side by side
in one run.

Every mark moves a row out of the unpublished partition: PostgreSQL runs the move as a DELETE
there. The guard is a statement-level AFTER DELETE trigger with a transition table on the
partitioned table and on that partition, which an UPDATE neither fires nor fills, so a mark
should pay nothing. Three workloads, runs interleaved, median of `--reps`:

  relay     outbox-migrate's relay (stdout sink into /dev/null); its sessions set
            `outbox_migrate.unpublished_guard = off`, which does not change what a mark does;
  update    a framework's own publisher: `UPDATE … SET published_at = now()` on batches of
            ids from a plain session;
  cleanup   a framework's cleanup of published rows, NServiceBus's shape: `DELETE … WHERE ctid
            IN (SELECT ctid … LIMIT batch)` from a plain session until nothing is left — the
            statement the guard exists for, which pays for the transition table.

The guard is the migration step's own SQL, created before a guarded run and dropped before an
unguarded one. Printed: rows per second without and with the guard and their ratio (goal for
the relay: >= 95 %), and the server's CPU time per row (the sessions' backends, read from
/proc: the guard's cost is server work, and CPU time moves far less than wall time with other
work on a shared machine) with the ratio unguarded / guarded.

    PYTHONPATH=. python bench/guard.py            # 100,000 rows, batch 500, 7 reps
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import create_partitioned_outbox

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns.kinds import guard
from outbox_migrate.patterns.names import Names
from outbox_migrate.relay.options import Mode, RelayOptions
from outbox_migrate.relay.sinks.stdout import StdoutSink
from outbox_migrate.relay.worker import Relay

SPEC = OutboxSpec()
NAMES = Names(SPEC)
FRAMEWORK_MARK = (
    "UPDATE outbox_new SET published_at = now() WHERE id IN (SELECT id FROM outbox_unpublished "
    "ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)"
)


def set_guard(conn: psycopg.Connection, guarded: bool) -> None:
    row = conn.execute(
        "SELECT count(*) FROM pg_proc WHERE proname = %s", (SPEC.guard_function,)
    ).fetchone()
    if bool(row and row[0]) != guarded:
        for statement in guard.create_sql(NAMES) if guarded else guard.drop_sql(NAMES):
            conn.execute(statement)


CLEANUP = (
    "DELETE FROM outbox_new WHERE ctid IN (SELECT ctid FROM outbox_new "
    "WHERE published_at IS NOT NULL LIMIT %s)"
)


def fill(conn: psycopg.Connection, rows: int, guarded: bool, published: bool = False) -> None:
    conn.execute("TRUNCATE outbox_new")
    conn.execute(
        "INSERT INTO outbox_new (event_type, message_key, payload) SELECT 'event', 'k-' || g, "
        "jsonb_build_object('n', g, 'pad', repeat('x', 16)) FROM generate_series(1, %s) g",
        (rows,),
    )
    if published:
        conn.execute("UPDATE outbox_new SET published_at = now()")
    conn.execute("VACUUM ANALYZE outbox_new")
    set_guard(conn, guarded)


def drain_relay(dsn: str, batch: int) -> float:
    with Path(os.devnull).open("w") as devnull:
        relay = Relay(
            dsn,
            lambda: StdoutSink(stream=devnull),
            spec=SPEC,
            options=RelayOptions(
                mode=Mode.partitioned, batch_size=batch, until_empty=True, listen=False
            ),
        )
        started = time.perf_counter()
        relay.run()
        return time.perf_counter() - started


def drain_with(statement: str) -> Callable[[str, int], float]:
    """A plain session running `statement` (a framework's mark or cleanup) until it touches no
    row: the time it took."""

    def drain(dsn: str, batch: int) -> float:
        with psycopg.connect(dsn, autocommit=True) as conn:
            started = time.perf_counter()
            while conn.execute(statement, (batch,)).rowcount:
                pass
            return time.perf_counter() - started

    return drain


def postmaster_pid(conn: psycopg.Connection) -> int:
    backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
    status = Path(f"/proc/{backend}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("PPid:")).split()[1])


def reaped_cpu_s(postmaster: int) -> float:
    """CPU time of the server's exited backends (utime + stime the postmaster reaped): a
    drain's sessions have all exited when it returns, so its server CPU is the difference.
    CPU time, unlike the drain's wall time, hardly moves with other work on the machine."""
    fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime


def wait_for_exit(conn: psycopg.Connection) -> None:
    """Until the drain's sessions are gone (and so reaped): only ours is left."""
    for _ in range(500):
        others = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND pid <> pg_backend_pid()"
        ).fetchone()
        if others == (0,):
            time.sleep(0.05)
            return
        time.sleep(0.01)
    raise RuntimeError("the drain's sessions did not exit")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--publishers", default="relay,update,cleanup")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    srv = pgserver.start(18)
    drains = {
        "relay": drain_relay,
        "update": drain_with(FRAMEWORK_MARK),
        "cleanup": drain_with(CLEANUP),
    }
    try:
        dsn = srv.dsn()
        print(f"PostgreSQL {srv.full_version}, {os.cpu_count()} CPUs, fsync off (throwaway); "
              f"{args.rows:,} rows, batch {args.batch}, median of {args.reps}")  # fmt: skip
        with psycopg.connect(dsn, autocommit=True) as conn:
            postmaster = postmaster_pid(conn)
            create_partitioned_outbox(conn, SPEC)
            for table in (SPEC.unpublished_partition, SPEC.published_partition):
                conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
            print(f"{'publisher':<10} {'unguarded msg/s':>16} {'guarded msg/s':>14} "
                  f"{'ratio':>7} {'server CPU µs/msg':>18} {'ratio':>7}")  # fmt: skip
            for publisher in args.publishers.split(","):
                rates: dict[bool, list[float]] = {False: [], True: []}
                cpu: dict[bool, list[float]] = {False: [], True: []}
                for rep in range(args.reps):
                    # interleaved, the order alternating: drift hits both alike
                    for guarded in (False, True) if rep % 2 else (True, False):
                        fill(conn, args.rows, guarded, published=publisher == "cleanup")
                        before = reaped_cpu_s(postmaster)
                        secs = drains[publisher](dsn, args.batch)
                        wait_for_exit(conn)
                        cpu[guarded].append((reaped_cpu_s(postmaster) - before) / args.rows)
                        left = conn.execute(
                            "SELECT count(*) FROM outbox_new WHERE published_at IS NULL OR %s",
                            (publisher == "cleanup",),
                        ).fetchone()
                        assert left == (0,), left
                        rates[guarded].append(args.rows / secs)
                bare, kept = statistics.median(rates[False]), statistics.median(rates[True])
                cpu_bare, cpu_kept = statistics.median(cpu[False]), statistics.median(cpu[True])
                print(f"{publisher:<10} {bare:>16,.0f} {kept:>14,.0f} {kept / bare:>7.1%} "
                      f"{cpu_bare * 1e6:>8.2f} → {cpu_kept * 1e6:<7.2f} "
                      f"{cpu_bare / cpu_kept:>7.1%}")  # fmt: skip
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
