"""Where the wake-up trigger's cost to the application goes, piece by piece, with pgbench.

bench/relay.py section 7 measures the trigger as an application sees it (Python writers, the
relay running). Its figures swing by several points between runs on a 2-vCPU VM, too much to
tell which part of the trigger costs what. This script removes the noise sources it can: the
writers are `pgbench` (C, prepared statements, 16 clients on 2 threads), nothing else runs,
and each variant of the trigger is measured in interleaved rounds, median of --reps.

Variants, each a statement-level AFTER INSERT trigger on the partitioned parent (the relay is
not running, so the idle flag is down, as while a relay is busy: the common case):

  none        no trigger (the baseline)
  empty       a plpgsql function that only returns: the floor of any trigger-based wake-up
  empty+tt    the same with the transition table the payload needs (REFERENCING NEW TABLE)
  hashed      the previous trigger: the key built per statement,
              hashtext('outbox-migrate.relay:' || TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME ...)
  spread      as `hashed` but the lock's second key spread over 16 values by backend pid
              (tests the lock-manager-partition contention hypothesis)
  installed   the trigger `relay --install-notify` installs now (a literal key)
  notify      the same without the idle flag: every INSERT notifies (what the flag saves)

fsync off, synchronous_commit on; the payload column is the bench's usual small JSON.

    python bench/trigger_parts.py              # 16 clients, 5 s per run, median of 5
    python bench/trigger_parts.py --clients 4 --seconds 3 --reps 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import create_partitioned_outbox
from psycopg import sql

from outbox_migrate.config import DEFAULT_CHANNEL, OutboxSpec
from outbox_migrate.patterns import notify

SPEC = OutboxSpec()
INSERT = (
    "INSERT INTO outbox_new (payload, event_type, message_key) "
    "VALUES ('{\"order\": 42, \"pad\": \"xxxxxxxxxxxxxxxx\"}', 'OrderCreated', 'k');\n"
)
_TRIGGER = (
    "CREATE TRIGGER relay_notify AFTER INSERT ON outbox_new {tt}"
    "FOR EACH STATEMENT EXECUTE FUNCTION bench_parts('{channel}')"
)
_TT = "REFERENCING NEW TABLE AS new_rows "
_NOTIFY = "PERFORM pg_notify(TG_ARGV[0], (SELECT min(id)::text FROM new_rows));"
_HASHED_KEY = (
    "hashtext('outbox-migrate.relay:' || TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME || ':idle')"
)


def _function(body: str) -> str:
    return (
        "CREATE OR REPLACE FUNCTION bench_parts() RETURNS trigger LANGUAGE plpgsql AS "
        f"$$ BEGIN {body} RETURN NULL; END $$"
    )


VARIANTS: dict[str, list[str | sql.Composed] | None] = {
    "none": [],
    "empty": [_function(""), _TRIGGER.format(tt="", channel=DEFAULT_CHANNEL)],
    "empty+tt": [_function(""), _TRIGGER.format(tt=_TT, channel=DEFAULT_CHANNEL)],
    "hashed": [
        _function(
            f"IF NOT pg_try_advisory_xact_lock_shared({_HASHED_KEY}, 0) THEN {_NOTIFY} END IF;"
        ),
        _TRIGGER.format(tt=_TT, channel=DEFAULT_CHANNEL),
    ],
    "spread": [
        _function(
            f"IF NOT pg_try_advisory_xact_lock_shared({_HASHED_KEY}, "
            f"pg_backend_pid() % 16) THEN {_NOTIFY} END IF;"
        ),
        _TRIGGER.format(tt=_TT, channel=DEFAULT_CHANNEL),
    ],
    "installed": None,  # notify.install
    # Without the idle flag: every INSERT notifies, whether the relay is busy or not.
    "notify": [_function(_NOTIFY), _TRIGGER.format(tt=_TT, channel=DEFAULT_CHANNEL)],
}


def _install(dsn: str, variant: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox_new")
        for drop in notify.drop_sql(SPEC):
            conn.execute(drop)
        conn.execute("DROP FUNCTION IF EXISTS bench_parts()")
        statements = VARIANTS[variant]
        if statements is None:
            notify.install(conn, SPEC, DEFAULT_CHANNEL)
        else:
            for statement in statements:
                conn.execute(statement)
        conn.execute("VACUUM ANALYZE outbox_new")


def _pgbench(tool: str, dsn: str, script: Path, clients: int, seconds: float) -> float:
    """Transactions per second of one pgbench run (single-row INSERT, autocommit)."""
    result = subprocess.run(
        [tool, "-n", "-M", "prepared", "-c", str(clients), "-j", "2", "-T", str(int(seconds)),
         "-f", str(script), dsn],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.search(r"tps = ([\d.]+)", result.stdout)
    if found is None:
        raise RuntimeError(f"pgbench printed no tps: {result.stdout[-500:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", default=",".join(VARIANTS), help="variants, comma-separated")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    started = time.perf_counter()
    srv = pgserver.start(18)
    try:
        dsn = srv.dsn()
        print(f"PostgreSQL {srv.full_version}, {os.cpu_count()} CPUs, fsync off; pgbench "
              f"-M prepared -c {args.clients} -j 2, {args.seconds:.0f} s per run, median of "
              f"{args.reps} interleaved rounds")  # fmt: skip
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_partitioned_outbox(conn, SPEC, start=1_000_000_000)
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "insert.sql"
            script.write_text(INSERT)
            os.chmod(tmp, 0o755)  # noqa: PTH101 - pgbench may run as another user
            runs: dict[str, list[float]] = {n: [] for n in names}
            for _ in range(args.reps):
                for name in names:
                    _install(dsn, name)
                    runs[name].append(_pgbench(srv.tool("pgbench"), dsn, script, args.clients,
                                               args.seconds))  # fmt: skip
        base = statistics.median(runs[names[0]])
        print(f"{'variant':<10} {'tps':>9} {'vs ' + names[0]:>9}  runs")
        for name in names:
            tps = statistics.median(runs[name])
            print(f"{name:<10} {tps:>9,.0f} {tps / base - 1:>+9.1%}  "
                  f"{', '.join(f'{r:,.0f}' for r in runs[name])}")  # fmt: skip
    finally:
        srv.stop()
    print(f"(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
