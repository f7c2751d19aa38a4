"""Relay benchmark: messages/s side by side, on one throwaway PostgreSQL 18, in one run.

Prints:
  1. throughput for batch sizes 100 and 1000: (a) the SQL-only limit (claim+mark as one
     statement, no broker), the relay on the partitioned outbox, (b) the relay on a flat
     outbox, (c) pgqueuer (a PyPI job queue) doing the same work — drain N rows/jobs;
  2. concurrent claimers: plain SKIP LOCKED vs the relay's sharded claim — rows/s and the share
     of batches that hit SQLSTATE 40001, for 1, 2 and 4 claimers;
 2b. relay processes (1, 2, 4; one worker each, shards balanced through advisory locks)
     draining rows inserted into the running relays, at batch 100 and 1000 — scaling past
     one Python process, with the relay processes' CPU beside the server's (/proc), so the
     side that limits shows; `--ordering key` asserts per-key order across the processes;
  3. claim latency (p50, p99) as published rows grow by publishing, flat vs partitioned,
     from id 0 (the spec's claim, the relay's periodic rescan) and from the relay's cursor;
  4. relay throughput while an idle REPEATABLE READ transaction holds back xmin;
  5. steady state: plain INSERTs paced at 1,000 and 5,000 msg/s from 1 and 4 writers,
     end-to-end p50/p99/max and relay CPU per 100 k messages, beside the CDC floor
     (pg_recvlogical + test_decoding) in the same run (bench/relay_steady.py);
  6. linger trade-off at 1,000 msg/s;
  7. the wake-up trigger's cost to the application's commits, 1..16 writers;
  8. late rows (committed after a higher id was published): delivery after their COMMIT with
     traffic stopped and at 1,000 msg/s, beside that traffic's own end-to-end.

Each section runs alone with --only (e.g. --only s); --quick shortens every section to a few
minutes in all.

The relay publishes through the stdout sink into /dev/null: the whole relay (claim, Message
objects, JSON envelopes, sink protocol, mark) runs, with no broker latency in the figures.

Default run: a few minutes. Bigger: --rows 1000000 --grow-to 10000000 --xmin-seconds 180.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import queue
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import relay_steady as steady
from fleet import cpu_s
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import (
    create_flat_outbox,
    create_partitioned_outbox,
    insert_rows,
)
from psycopg import sql

from outbox_migrate.cli.relay_cmd import RELAY_SWITCH_INTERVAL_S
from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay import queries
from outbox_migrate.relay.options import Mode, Ordering, RelayOptions
from outbox_migrate.relay.sinks import SinkFactory
from outbox_migrate.relay.sinks.stdout import StdoutSink
from outbox_migrate.relay.worker import Relay, running

SPEC = OutboxSpec()
INSERT_CHUNK = 200_000
CLAIM_SAMPLES = 2000
LATENCY_ROUNDS = 5
NO_CURSOR_MAX_S = 10.0
GROW_CHUNK = 500_000
ACK_LATENCY_S = 0.005
LATENCY_ROWS = 20_000


def reset(
    conn: psycopg.Connection, rows: int, *, flat: bool = False, payload_bytes: int = 16
) -> None:
    table = "outbox" if flat else "outbox_new"
    conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(table)))
    fill(conn, table, rows, payload_bytes=payload_bytes)
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))


def fill(
    conn: psycopg.Connection,
    table: str,
    rows: int,
    *,
    published: bool = False,
    payload_bytes: int = 16,
) -> None:
    """`rows` rows in chunks; `payload_bytes` is the payload's padding (insert_rows)."""
    done = 0
    while done < rows:
        step = min(INSERT_CHUNK, rows - done)
        insert_rows(conn, table, step, spec=SPEC, published=published, payload_bytes=payload_bytes)
        done += step


def unpublished(conn: psycopg.Connection, flat: bool = False) -> int:
    query = (
        "SELECT count(*) FROM outbox WHERE published_at IS NULL"
        if flat
        else "SELECT count(*) FROM outbox_unpublished"
    )
    row = conn.execute(query).fetchone()
    return int(row[0]) if row else -1


# -- claimers ------------------------------------------------------------------------------


def sql_only(
    dsn: str,
    batch: int,
    claimers: int,
    *,
    sharded: bool,
    flat: bool = False,
    max_s: float | None = None,
) -> tuple[float, int, int]:
    """Claim+mark in one statement until empty (or `max_s`). Returns (s, batches, retries)."""
    source = queries.flat_source(SPEC) if flat else queries.partitioned_source(SPEC)
    statement = queries.claim_and_mark(source, sharded=sharded and claimers > 1)
    counts = {"batches": 0, "retries": 0, "rows": 0}
    lock = threading.Lock()
    deadline = time.monotonic() + max_s if max_s else None

    def claimer(index: int) -> None:
        params: dict[str, Any] = {"limit": batch}
        if sharded and claimers > 1:
            params.update(shards=claimers, mine=[index])
        with psycopg.connect(dsn, autocommit=True) as conn:
            # The index plan, as the relay's sessions use: without these the planner picks a
            # hash join over a scan of the whole unpublished partition at batch 1000 (13.7 ms
            # per batch at 100 k rows instead of 3.1 ms), a slow baseline. `plan` prints it.
            conn.execute(queries.claim_session_settings())
            for setting in INDEX_PLAN:
                conn.execute(setting)
            batches = retries = marked = 0
            while deadline is None or time.monotonic() < deadline:
                try:
                    rowcount = conn.execute(statement, params).rowcount
                except psycopg.errors.SerializationFailure:
                    retries += 1
                    continue
                batches += 1
                marked += rowcount
                if rowcount == 0:
                    break
            with lock:
                counts["batches"] += batches
                counts["retries"] += retries
                counts["rows"] += marked

    started = time.perf_counter()
    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(claimers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if max_s:  # time-boxed: report the rate as if `rows` were all done at that pace
        return elapsed, counts["rows"], counts["retries"]
    return elapsed, counts["batches"], counts["retries"]


INDEX_PLAN = (
    "SET enable_seqscan = off",
    "SET enable_hashjoin = off",
    "SET enable_mergejoin = off",
)


def plan(dsn: str, batch: int) -> str:
    """The SQL-only statement's plan at this batch size, in one line (nodes only)."""
    source = queries.partitioned_source(SPEC)
    statement = queries.claim_and_mark(source, sharded=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(queries.claim_session_settings())
        for setting in INDEX_PLAN:
            conn.execute(setting)
        with conn.transaction(force_rollback=True):
            rows = conn.execute(
                sql.SQL("EXPLAIN (COSTS OFF) {}").format(statement), {"limit": batch}
            ).fetchall()
    nodes = [str(r[0]).strip().lstrip("-> ").split("  ")[0] for r in rows]
    keep = ("Update", "Nested Loop", "Hash Join", "Merge Join", "Seq Scan", "Index Scan",
            "Index Only Scan", "Bitmap", "Tid Scan", "Limit", "LockRows", "Sort")  # fmt: skip
    return " > ".join(n for n in nodes if n.startswith(keep))


class AckLatencySink(StdoutSink):
    """The stdout sink plus a fixed wait per batch: a broker's acknowledgement round trip."""

    def __init__(self, stream: Any, latency_s: float) -> None:
        super().__init__(stream=stream)
        self.latency_s = latency_s

    def publish(self, batch: Any) -> None:
        super().publish(batch)
        if self.latency_s:  # time.sleep(0) is still a system call and a trip through the GIL
            time.sleep(self.latency_s)


def relay_run(
    dsn: str,
    batch: int,
    workers: int,
    mode: Mode,
    ack_latency_s: float = 0.0,
    read_ahead: bool = True,
    sink_factory: SinkFactory | None = None,
) -> tuple[float, Relay]:
    """Drain the outbox with a relay (until empty); (seconds until `run` returned, relay).
    The sink: `sink_factory`'s, or stdout into /dev/null with `ack_latency_s` per batch."""
    devnull = Path(os.devnull).open("w")  # noqa: SIM115 - closed below
    try:
        relay = Relay(
            dsn,
            sink_factory or (lambda: AckLatencySink(devnull, ack_latency_s)),
            spec=SPEC,
            options=RelayOptions(
                mode=mode,
                batch_size=batch,
                workers=workers,
                until_empty=True,
                listen=False,
                read_ahead=read_ahead,
            ),
        )
        started = time.perf_counter()
        relay.run()
        return time.perf_counter() - started, relay
    finally:
        devnull.close()


def pgqueuer_run(dsn: str, rows: int, batch: int) -> float | None:
    """pgqueuer: enqueue `rows` jobs, then drain them with a no-op entrypoint."""
    try:
        from pgqueuer import PsycopgDriver, Queries, QueueManager
        from pgqueuer.domain.types import QueueExecutionMode
    except ImportError:
        return None

    async def main() -> float:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            driver = PsycopgDriver(conn)
            q = Queries(driver)
            if not await q.schema_is_installed():
                await q.install()
            payload = b'{"n": 1, "pad": "xxxxxxxxxxxxxxxx"}'
            for start in range(0, rows, 10_000):
                n = min(10_000, rows - start)
                await q.enqueue(["publish"] * n, [payload] * n, [0] * n)
            qm = QueueManager(q)
            done = {"jobs": 0, "last": 0.0}

            async def publish(job: Any) -> None:
                done["jobs"] += 1
                done["last"] = time.perf_counter()

            qm.entrypoint("publish")(publish)  # not as a decorator: untyped without pgqueuer

            started = time.perf_counter()
            await qm.run(batch_size=batch, mode=QueueExecutionMode.drain)
            # Timed to its last job, not to run() returning: drain mode keeps polling for a
            # few seconds after the queue is empty, which is not work done.
            assert done["jobs"] == rows, done
            return done["last"] - started
        finally:
            await conn.close()

    return asyncio.run(main())


# -- sections -------------------------------------------------------------------------------


def measure(reps: int, run: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """Median rate (and median retry share) over `reps` runs: the machine may be shared."""
    results = [run() for _ in range(reps)]
    return (
        statistics.median(r[0] for r in results),
        statistics.median(r[1] for r in results),
    )


def sql_rate(dsn: str, conn: psycopg.Connection, rows: int, batch: int, claimers: int,
             sharded: bool) -> Callable[[], tuple[float, float]]:  # fmt: skip
    def run() -> tuple[float, float]:
        reset(conn, rows)
        secs, batches, retries = sql_only(dsn, batch, claimers, sharded=sharded)
        assert unpublished(conn) == 0
        return rows / secs, retries / max(1, batches + retries)

    return run


def relay_rate(
    dsn: str,
    conn: psycopg.Connection,
    rows: int,
    batch: int,
    workers: int,
    mode: Mode,
    ack_latency_s: float = 0.0,
    read_ahead: bool = True,
) -> Callable[[], tuple[float, float]]:
    flat = mode is Mode.flat

    def run() -> tuple[float, float]:
        reset(conn, rows, flat=flat)
        secs, relay = relay_run(dsn, batch, workers, mode, ack_latency_s, read_ahead)
        assert relay.stats.published == rows and unpublished(conn, flat=flat) == 0
        return rows / secs, relay.stats.serialization_retries / max(1, relay.stats.batches)

    return run


def section_throughput(
    dsn: str, conn: psycopg.Connection, rows: int, peer_rows: int, reps: int
) -> None:
    print(f"\n## 1. Throughput, {rows:,} rows, median of {reps} (messages/s)")
    header = f"{'batch':>6} {'(a) SQL-only':>13} {'relay part.':>12} {'no read-ahead':>14} "
    header += f"{'relay x2':>9} "
    header += f"{'(b) relay flat':>15} {'(c) pgqueuer':>13} {'relay/(a)':>10} {'x2/(a)':>7} "
    header += f"{'relay/(c)':>10} {'part/flat':>10}"
    print(header)
    for batch in (100, 1000):
        sql, _ = measure(reps, sql_rate(dsn, conn, rows, batch, 1, False))
        part, _ = measure(reps, relay_rate(dsn, conn, rows, batch, 1, Mode.partitioned))
        alone, _ = measure(
            reps, relay_rate(dsn, conn, rows, batch, 1, Mode.partitioned, read_ahead=False)
        )
        two, _ = measure(reps, relay_rate(dsn, conn, rows, batch, 2, Mode.partitioned))
        flat, _ = measure(reps, relay_rate(dsn, conn, rows, batch, 1, Mode.flat))
        peer = None
        if peer_rows:
            peer_secs = pgqueuer_run(dsn, peer_rows, batch)
            peer = peer_rows / peer_secs if peer_secs else None
        peer_text = f"{peer:>13,.0f}" if peer else f"{'n/a':>13}"
        ratio_peer = f"{part / peer:>9.1f}x" if peer else f"{'n/a':>10}"
        print(
            f"{batch:>6} {sql:>13,.0f} {part:>12,.0f} {alone:>14,.0f} {two:>9,.0f} "
            f"{flat:>15,.0f} {peer_text} "
            f"{part / sql:>9.0%} {two / sql:>6.0%} {ratio_peer} {part / flat:>9.2f}x"
        )
    if peer_rows:
        print(f"(pgqueuer: {peer_rows:,} jobs enqueued, then drained by a no-op entrypoint; "
              "timed to its last job)")  # fmt: skip
    for batch in (100, 1000):
        print(f"(a) SQL-only plan at batch {batch}: {plan(dsn, batch)}")


def section_read_ahead(dsn: str, conn: psycopg.Connection, rows: int, reps: int) -> None:
    """Read-ahead on and off, runs interleaved (on, off, on, off, ...): what it is kept for."""
    print(f"\n## r. Read-ahead, {rows:,} rows, 1 worker, interleaved, median of {reps} (msg/s)")
    print(f"{'batch':>6} {'ack ms':>7} {'on':>9} {'off':>9} {'on/off':>7}  runs on | off")
    for batch, ack_s in ((100, 0.0), (1000, 0.0), (100, 0.001)):
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(reps):
            for ahead in (True, False):
                rate = relay_rate(dsn, conn, rows, batch, 1, Mode.partitioned, ack_s, ahead)
                runs[ahead].append(rate()[0])
        on, off = statistics.median(runs[True]), statistics.median(runs[False])
        print(f"{batch:>6} {ack_s * 1000:>7.0f} {on:>9,.0f} {off:>9,.0f} {on / off:>7.0%}  "
              f"{', '.join(f'{r:,.0f}' for r in runs[True])} | "
              f"{', '.join(f'{r:,.0f}' for r in runs[False])}")  # fmt: skip


def section_claimers(dsn: str, conn: psycopg.Connection, rows: int, batch: int, reps: int) -> None:
    print(f"\n## 2. Concurrent claimers, partitioned outbox, {rows:,} rows, batch {batch}, "
          f"median of {reps}")  # fmt: skip
    print(f"{'claimers':>8} {'plain rows/s':>13} {'plain 40001':>12} {'sharded rows/s':>15} "
          f"{'sharded 40001':>14} {'relay rows/s':>13} {'relay 40001':>12} "
          f"{'relay, 5 ms acks, batch 100':>28} {'40001':>6}")  # fmt: skip
    for claimers in (1, 2, 4):
        plain = measure(reps, sql_rate(dsn, conn, rows, batch, claimers, False))
        sharded = measure(reps, sql_rate(dsn, conn, rows, batch, claimers, True))
        relay = measure(reps, relay_rate(dsn, conn, rows, batch, claimers, Mode.partitioned))
        slow = measure(reps, relay_rate(dsn, conn, LATENCY_ROWS, 100, claimers,
                                        Mode.partitioned, ACK_LATENCY_S))  # fmt: skip
        print(
            f"{claimers:>8} {plain[0]:>13,.0f} {plain[1]:>12.1%} {sharded[0]:>15,.0f} "
            f"{sharded[1]:>14.1%} {relay[0]:>13,.0f} {relay[1]:>12.1%} {slow[0]:>28,.0f} "
            f"{slow[1]:>6.1%}"
        )
    print("(40001 = share of claim statements that failed with SQLSTATE 40001 and were retried;")
    print(f" '5 ms acks': {LATENCY_ROWS:,} rows, the sink waits 5 ms per batch of 100 like a "
          "broker's acknowledgement)")  # fmt: skip


PROCESS_SHARDS = 8
"""Shards every relay process of the process-scaling run is told (`--shards`), as a
deployment of several relay processes on one outbox must."""
BALANCE_WAIT_S = 2.5
PROCESS_POLL_S = 0.002
READY_TIMEOUT_S = 60.0
DRAIN_STALL_S = 60.0
"""No row published for this long: the relay processes are stuck, stop the section."""


class _KeySink(StdoutSink):
    """The stdout sink (into /dev/null) that notes (when, id, key) of each message, to check
    per-key order across the processes afterwards."""

    def __init__(self, stream: Any, seen: list[tuple[float, int, str]]) -> None:
        super().__init__(stream=stream)
        self.seen = seen

    def publish(self, batch: Any) -> None:
        super().publish(batch)
        now = time.monotonic()
        self.seen.extend((now, m.id, m.key) for m in batch)


def _relay_process(
    dsn: str, batch: int, ordering: Ordering, ready: Any, stop: Any, out: Any
) -> None:
    """One relay process (1 worker, stdout sink into /dev/null) until `stop` is set; with
    `--ordering key` it sends what it published, in order, to `out`."""
    seen: list[tuple[float, int, str]] = []
    record = ordering is Ordering.key
    with Path(os.devnull).open("w") as devnull:
        relay = Relay(
            dsn,
            (lambda: _KeySink(devnull, seen)) if record else (lambda: StdoutSink(stream=devnull)),
            spec=SPEC,
            # The linger must fit in the poll interval (RelayOptions refuses it otherwise):
            # the default 5 ms linger with a 2 ms poll made every child fail at start.
            options=RelayOptions(
                batch_size=batch, shards=PROCESS_SHARDS, listen=False, ordering=ordering,
                poll_interval_s=PROCESS_POLL_S, linger_s=PROCESS_POLL_S,
            ),
        )  # fmt: skip
        with running(relay):
            ready.set()
            stop.wait()
    out.put(seen)


def wait_drained(conn: psycopg.Connection, children: Sequence[Any] = ()) -> None:
    """Until the unpublished partition is empty; fails (instead of waiting for ever) when a
    relay process of `children` died or no row was published for DRAIN_STALL_S. The stall
    check counts rows once a second only: the 2 ms emptiness probe stays as cheap as before."""
    query = "SELECT 1 FROM outbox_unpublished ORDER BY id LIMIT 1"
    count = "SELECT count(*) FROM outbox_unpublished"
    last, moved = -1, time.monotonic()
    next_check = moved + 1.0
    while conn.execute(query).fetchone() is not None:
        now = time.monotonic()
        if now >= next_check:
            next_check = now + 1.0
            (left,) = conn.execute(count).fetchone() or (0,)
            if left != last:
                last, moved = left, now
            dead = [c.exitcode for c in children if not c.is_alive()]
            if dead or now - moved > DRAIN_STALL_S:
                raise SystemExit(
                    f"relay processes stalled: {left} rows left, exit codes of the dead: {dead}"
                )
        time.sleep(0.002)


def wait_ready(children: Sequence[Any], readies: Sequence[Any]) -> None:
    """Until every relay process has started; a process that exited first is an error (its
    traceback is on stderr), not a 60-second wait per process and then a hang."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all(ready.is_set() for ready in readies):
        dead = [c.exitcode for c in children if not c.is_alive()]
        if dead or time.monotonic() > deadline:
            raise SystemExit(f"relay processes did not start: exit codes {dead}")
        time.sleep(0.05)


PROCESS_KEYS = 64
"""Distinct message keys in the process-scaling rows (each key many messages, so that per-key
order is something to keep)."""


def fill_keyed(conn: psycopg.Connection, rows: int) -> None:
    """`rows` unpublished rows in one transaction, keys k0..k63 in turn."""
    conn.execute(
        "INSERT INTO outbox_new (event_type, message_key, payload) "
        "SELECT 'event', 'k' || (g %% %(keys)s), json_build_object('n', g, 'pad', "
        "repeat('x', 16)) FROM generate_series(1, %(rows)s) g",
        {"keys": PROCESS_KEYS, "rows": rows},
    )


def server_pids(conn: psycopg.Connection) -> list[int]:
    """The server's processes (backends, background workers) but this session's own."""
    query = "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
    return [int(r[0]) for r in conn.execute(query).fetchall()]


def order_violations(deliveries: list[list[tuple[float, int, str]]]) -> int:
    """Messages of a key first delivered after a higher id of the same key (the processes'
    lists merged by delivery time; within one process, in the order it published)."""
    merged = sorted(
        (when, proc, seq, id_, key)
        for proc, seen in enumerate(deliveries)
        for seq, (when, id_, key) in enumerate(seen)
    )
    last: dict[str, int] = {}
    delivered: set[int] = set()
    bad = 0
    for _when, _proc, _seq, id_, key in merged:
        if id_ in delivered:  # a redelivery: order is about first deliveries
            continue
        delivered.add(id_)
        if id_ < last.get(key, -1):
            bad += 1
        last[key] = max(id_, last.get(key, -1))
    return bad


@dataclass
class FleetRun:
    rate: float
    relay_cpu_s: float
    pg_cpu_s: float
    seconds: float
    misordered: int | None


def processes_run(
    dsn: str, conn: psycopg.Connection, rows: int, batch: int, processes: int, ordering: Ordering
) -> FleetRun:
    """Relay processes already running (and balanced: each owns its share of the shards):
    insert `rows` in one transaction, time until the unpublished partition is empty; the CPU
    the relay processes and the server's processes spent meanwhile (/proc)."""
    import multiprocessing

    reset(conn, 0)
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    readies = [ctx.Event() for _ in range(processes)]
    children = [
        ctx.Process(target=_relay_process, args=(dsn, batch, ordering, ready, stop, out))
        for ready in readies
    ]
    for child in children:
        child.start()
    deliveries: list[list[tuple[float, int, str]]] = []
    try:
        wait_ready(children, readies)
        time.sleep(BALANCE_WAIT_S)  # rebalancing: each process settles on its fair share
        relay_pids = [c.pid for c in children if c.pid is not None]
        pg_pids = server_pids(conn)
        relay_before, pg_before = cpu_s(relay_pids), cpu_s(pg_pids)
        fill_keyed(conn, rows)
        started = time.perf_counter()
        wait_drained(conn, children)
        secs = time.perf_counter() - started
        relay_cpu = cpu_s(relay_pids) - relay_before
        pg_cpu = cpu_s(pg_pids) - pg_before  # the insert's own backend is this session's
    finally:
        stop.set()
        for child in children:
            if child.is_alive() or child.exitcode == 0:
                with contextlib.suppress(queue.Empty):
                    deliveries.append(out.get(timeout=60))
        for child in children:
            child.join(30)
    assert unpublished(conn) == 0
    misordered = None
    if ordering is Ordering.key:
        assert sum(len(d) for d in deliveries) >= rows, "a process's deliveries are missing"
        misordered = order_violations(deliveries)
        assert misordered == 0, f"{misordered} messages delivered after a higher id of their key"
    return FleetRun(rows / secs, relay_cpu, pg_cpu, secs, misordered)


def section_processes(
    dsn: str, conn: psycopg.Connection, rows: int, reps: int, ordering: Ordering
) -> None:
    counts = [1, 2, 4]
    print(f"\n## 2b. Relay processes (1 worker each, {PROCESS_SHARDS} shards, --ordering "
          f"{ordering}), {rows:,} rows ({PROCESS_KEYS} keys) inserted at once into running, "
          f"balanced relays, median of {reps} interleaved rounds; CPU from /proc: the relay "
          f"processes' and the server's (every pg_stat_activity pid)")  # fmt: skip
    print(f"{'batch':>5} {'procs':>5} {'msg/s':>9} {'vs 1':>6} {'relay µs/msg':>12} "
          f"{'PG µs/msg':>9} {'relay cores':>11} {'per proc':>8} {'PG cores':>8} "
          f"{'cores busy':>10}")  # fmt: skip
    for batch in (100, 1000):
        runs: dict[int, list[FleetRun]] = {n: [] for n in counts}
        for _ in range(reps):  # interleaved: 1, 2, 4, 1, 2, 4, ... (the load drifts)
            for n in counts:
                runs[n].append(processes_run(dsn, conn, rows, batch, n, ordering))
        base = 0.0
        for n in counts:
            rs = runs[n]
            rate = statistics.median(r.rate for r in rs)
            relay_us = statistics.median(r.relay_cpu_s / rows * 1e6 for r in rs)
            pg_us = statistics.median(r.pg_cpu_s / rows * 1e6 for r in rs)
            relay_cores = statistics.median(r.relay_cpu_s / r.seconds for r in rs)
            pg_cores = statistics.median(r.pg_cpu_s / r.seconds for r in rs)
            base = base or rate
            print(f"{batch:>5} {n:>5} {rate:>9,.0f} {rate / base:>5.2f}x {relay_us:>12.1f} "
                  f"{pg_us:>9.1f} {relay_cores:>11.2f} {relay_cores / n:>8.2f} "
                  f"{pg_cores:>8.2f} {relay_cores + pg_cores:>10.2f}")  # fmt: skip
    if ordering is Ordering.key:
        print("(per-key order checked in every run: no message of a key was first delivered "
              "after a higher id of the same key)")  # fmt: skip
    print(
        f"(the stdout sink into /dev/null: no broker; PostgreSQL shares the same "
        f"{os.cpu_count()} CPUs; cores busy = relay + PG CPU over the drain's wall time)"
    )


def claim_latencies(dsn: str, flat: bool, batch: int, *, cursor: bool) -> list[float]:
    """Claim (and roll back) CLAIM_SAMPLES times: from id 0, or from the relay's cursor (just
    below the oldest unpublished row, where a running relay's frontier is)."""
    source = queries.flat_source(SPEC) if flat else queries.partitioned_source(SPEC)
    claim = queries.claim(source, queries.Columns("event_type", "message_key"), sharded=False,
                          by_key=False)  # fmt: skip
    samples: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(queries.claim_session_settings())
        after = 0
        if cursor:
            row = conn.execute(
                sql.SQL("SELECT min({id}) - 1 FROM {table} WHERE {unpublished}").format(
                    id=sql.Identifier(source.id_column),
                    table=source.claim_ident,
                    unpublished=source.unpublished_filter(),
                )
            ).fetchone()
            after = int(row[0]) if row and row[0] is not None else 0
        for _ in range(CLAIM_SAMPLES):
            started = time.perf_counter()
            with conn.transaction(force_rollback=True):
                conn.execute(claim, {"after": after, "limit": batch}).fetchall()
            samples.append(time.perf_counter() - started)
    return samples


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98]


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


def grow_by_publishing(dsn: str, conn: psycopg.Connection, table: str, rows: int) -> None:
    """Add `rows` published rows the way production does: insert unpublished, then claim and
    mark them (one-statement loop), with autovacuum left to its defaults."""
    flat = table == "outbox"
    done = 0
    while done < rows:
        step = min(GROW_CHUNK, rows - done)
        fill(conn, table, step)
        sql_only(dsn, 1000, 1, sharded=False, flat=flat)
        done += step


AUTOVACUUM_SETTLE_MAX_S = 300.0


def wait_for_autovacuum(conn: psycopg.Connection) -> float:
    """Wait until no autovacuum worker runs (at most AUTOVACUUM_SETTLE_MAX_S); returns the wait.

    Growing the outbox by millions of rows in a minute leaves autovacuum minutes of work on
    the *published* partition. On two shared vCPUs that work shows up in any latency
    measured meanwhile, whatever is being measured; the claim itself reads the unpublished
    partition only. Each size is therefore sampled once autovacuum has caught up, as it keeps
    up with an outbox that grows at production pace, and the wait is printed.
    """
    started = time.monotonic()
    query = "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
    quiet = 0
    while time.monotonic() - started < AUTOVACUUM_SETTLE_MAX_S:
        row = conn.execute(query).fetchone()
        quiet = quiet + 1 if row and row[0] == 0 else 0
        if quiet >= 3:  # three checks in a row: not just between two tables
            break
        time.sleep(1.0)
    return time.monotonic() - started


def section_growth(
    dsn: str, conn: psycopg.Connection, grow_to: int, batch: int, *, flat: bool = True
) -> None:
    """Claim latency as published rows grow, against a *baseline* measured at the same moment.

    The baseline is the same two outboxes in another database, with the same 10,000-row
    backlog and nothing ever published. Each round samples the grown tables and the baseline
    alternately, so on a shared machine a burst of load lands on both; the ratio grown/baseline
    is the effect of the published rows (the goal: at most 1.2x for the partitioned claim).
    """
    sizes = [0] + [s for s in (1_000_000, 3_000_000, 10_000_000) if s <= grow_to]
    if grow_to not in sizes:
        sizes.append(grow_to)
    conn.execute("DROP DATABASE IF EXISTS latency_baseline")
    conn.execute("CREATE DATABASE latency_baseline")
    base_dsn = dsn.replace("dbname=postgres", "dbname=latency_baseline")
    with psycopg.connect(base_dsn, autocommit=True) as base_conn:
        create_flat_outbox(base_conn, SPEC)
        create_partitioned_outbox(base_conn, SPEC, start=1_000_000_000)
        for table in ("outbox", "outbox_new"):
            fill(base_conn, table, 10_000)
            base_conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))
    print(f"\n## 3. Claim latency (ms, batch {batch}, 10,000 unpublished rows) as published "
          "rows grow by publishing; p99 (p50); part./base = partitioned p99 over the baseline's "
          "(nothing published) sampled alternately with it")  # fmt: skip
    print(f"{'published':>11} {'flat, from id 0':>17} {'part., from id 0':>17} "
          f"{'flat, cursor':>15} {'part., cursor':>15} {'part./base id 0':>16} "
          f"{'part./base cursor':>18}")  # fmt: skip
    tables = ("outbox", "outbox_new") if flat else ("outbox_new",)
    for table in tables:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(table)))
    variants = [(True, False), (False, False), (True, True), (False, True)]
    sampled = [i for i, (is_flat, _c) in enumerate(variants) if flat or not is_flat]
    results: list[list[float]] = []
    have = 0
    for size in sizes:
        for table in tables:
            grow_by_publishing(dsn, conn, table, size - have)
            fill(conn, table, 10_000)  # the backlog the claims are measured against
        have = size
        settled = wait_for_autovacuum(conn)
        rounds = []
        for _ in range(LATENCY_ROUNDS):
            grown = {i: claim_latencies(dsn, variants[i][0], batch, cursor=variants[i][1])
                     for i in sampled}  # fmt: skip
            baseline = {i: claim_latencies(base_dsn, variants[i][0], batch,
                                           cursor=variants[i][1]) for i in sampled}  # fmt: skip
            rounds.append((grown, baseline))
        cells = []
        row_p99 = []
        for i in range(len(variants)):
            if i not in sampled:  # --no-flat-growth
                row_p99.append(float("nan"))
                cells.append("-")
                continue
            q99 = statistics.median(p99(g[i]) for g, _b in rounds) * 1000
            q50 = statistics.median(p50(g[i]) for g, _b in rounds) * 1000
            row_p99.append(q99)
            cells.append(f"{q99:.2f} ({q50:.2f})")
        ratios = [statistics.median(p99(g[i]) / p99(b[i]) for g, b in rounds) for i in (1, 3)]
        row_p99 += ratios
        results.append(row_p99)
        print(f"{size:>11,} {cells[0]:>17} {cells[1]:>17} {cells[2]:>15} {cells[3]:>15} "
              f"{ratios[0]:>15.2f}x {ratios[1]:>17.2f}x   (autovacuum settled after "
              f"{settled:.0f} s)")  # fmt: skip
        for table in tables:
            sql_only(dsn, 1000, 1, sharded=False, flat=table == "outbox")  # publish the backlog
        have += 10_000
    first, last = results[0], results[-1]
    print(f"p99 at {sizes[-1]:,} vs empty (minutes apart): partitioned {last[1] / first[1]:.2f}x "
          f"from id 0, {last[3] / first[3]:.2f}x from the cursor; flat {last[0] / first[0]:.2f}x / "
          f"{last[2] / first[2]:.2f}x")  # fmt: skip
    print(f"p99 at {sizes[-1]:,} vs the baseline sampled alongside: partitioned {last[4]:.2f}x "
          f"from id 0, {last[5]:.2f}x from the cursor")  # fmt: skip


def steady_rate(relay: Relay, conn: psycopg.Connection, rows: int) -> float:
    """Rows/s a running relay publishes `rows` rows that arrive in one transaction."""
    before = relay.stats.published
    fill(conn, "outbox_new", rows)
    started = time.perf_counter()
    while relay.stats.published - before < rows:
        time.sleep(0.002)
    return rows / (time.perf_counter() - started)


def _relay_for(dsn: str, devnull: Any, batch: int) -> Relay:
    return Relay(
        dsn,
        lambda: StdoutSink(stream=devnull),
        spec=SPEC,
        options=RelayOptions(batch_size=batch, poll_interval_s=0.05),
    )


def section_xmin(dsn: str, conn: psycopg.Connection, rows: int, hold_s: float, batch: int) -> None:
    """Throughput of a running relay before and after `hold_s` of churn under a held xmin.

    Measured against a *control*: the same relay on an identical outbox in another database of
    the same server, where the held snapshot does not hold back vacuum (horizons are per
    database for ordinary tables). Both are measured alternately and churned alike, so a
    change in the machine's load moves both; the held-xmin effect is the change of the ratio.
    """
    print(f"\n## 4. Running relay's throughput while xmin is held ({hold_s:.0f} s of churn)")
    reset(conn, 0)
    conn.execute("DROP DATABASE IF EXISTS xmin_control")
    conn.execute("CREATE DATABASE xmin_control")
    control_dsn = dsn.replace("dbname=postgres", "dbname=xmin_control")
    devnull = Path(os.devnull).open("w")  # noqa: SIM115 - closed below
    control_conn = psycopg.connect(control_dsn, autocommit=True)
    create_partitioned_outbox(control_conn, SPEC, start=1_000_000_000)
    relay, control = _relay_for(dsn, devnull, batch), _relay_for(control_dsn, devnull, batch)
    holder = psycopg.connect(dsn)

    def paired() -> tuple[float, float]:
        """(held side, control side): medians of three alternating measurements."""
        held_side, control_side = [], []
        for _ in range(3):
            held_side.append(steady_rate(relay, conn, rows))
            control_side.append(steady_rate(control, control_conn, rows))
        return statistics.median(held_side), statistics.median(control_side)

    try:
        with running(relay), running(control):
            time.sleep(0.5)
            base, base_control = paired()
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM outbox_new").fetchone()  # takes the snapshot
            # Churn under the held snapshot: rows inserted and published; their dead versions
            # pile up in the unpublished partition and its index (nothing can be pruned).
            churned_from = relay.stats.published
            deadline = time.monotonic() + hold_s
            while time.monotonic() < deadline:
                steady_rate(relay, conn, 20_000)
                steady_rate(control, control_conn, 20_000)
            churned = relay.stats.published - churned_from
            held, held_control = paired()
        # The spec's claim for contrast: always from the lowest id, no cursor.
        fill(conn, "outbox_new", rows)
        secs, marked, _r = sql_only(dsn, batch, 1, sharded=False, max_s=NO_CURSOR_MAX_S)
        no_cursor = marked / secs
    finally:
        holder.rollback()
        holder.close()
        control_conn.close()
        devnull.close()
    effect = (held / held_control) / (base / base_control) - 1
    raw, drift = held / base - 1, held_control / base_control - 1
    print(
        f"relay before: {base:,.0f} rows/s (control {base_control:,.0f}); after {churned:,} "
        f"rows churned under the held xmin: {held:,.0f} rows/s (control {held_control:,.0f})"
    )
    print(
        f"raw change {raw:+.1%}; control's change {drift:+.1%}; "
        f"held-xmin effect (ratio to control) {effect:+.1%}"
    )
    print(f"the spec's claim (always from the lowest id, SQL-only) under that xmin: "
          f"{no_cursor:,.0f} rows/s")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--peer-rows", type=int, default=20_000, help="pgqueuer jobs (0: skip)")
    parser.add_argument("--reps", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--claimer-rows", type=int, default=100_000)
    parser.add_argument("--claimer-batch", type=int, default=1000)
    parser.add_argument("--grow-to", type=int, default=1_000_000)
    parser.add_argument("--xmin-seconds", type=float, default=20.0)
    parser.add_argument("--only", default="12p34sltk", help="sections to run, e.g. 12p or s")
    parser.add_argument("--quick", action="store_true", help="small sizes: minutes, not more")
    parser.add_argument(
        "--ordering",
        choices=[o.value for o in Ordering],
        default=Ordering.none.value,
        help="section 2b's relays' --ordering; with key, per-key order is asserted",
    )
    parser.add_argument("--steady-seconds", type=float, default=20.0)
    parser.add_argument("--trigger-seconds", type=float, default=8.0)
    parser.add_argument(
        "--trigger-fsync",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="section 7 with fsync on (the NOTIFY lock is then held across a real WAL flush; "
        "on a shared disk the figures follow the other tenants' I/O)",
    )
    parser.add_argument(
        "--no-flat-growth",
        action="store_true",
        help="section 3: grow and sample the partitioned outbox only (growing a flat outbox "
        "by publishing slows down as published rows pile up: that is the problem)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.peer_rows, args.reps = 50_000, 5_000, 2
        args.claimer_rows, args.grow_to, args.xmin_seconds = 50_000, 200_000, 10.0
        args.steady_seconds, args.trigger_seconds = 8.0, 4.0

    started = time.perf_counter()
    # SIGTERM (a CI timeout, kill) must still run the `finally` that stops the server.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    # As `outbox-migrate relay --workers N` does (see cli/relay_cmd.py).
    sys.setswitchinterval(RELAY_SWITCH_INTERVAL_S)
    srv = pgserver.start(18, settings={"autovacuum": "on"})
    try:
        dsn = srv.dsn()
        print(f"PostgreSQL {srv.full_version}, {os.cpu_count()} CPUs, fsync off (throwaway); "
              f"{steady.load_note()} at start")  # fmt: skip
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_flat_outbox(conn, SPEC)
            create_partitioned_outbox(conn, SPEC, start=1_000_000_000)
            sections: dict[str, Callable[[], None]] = {
                "1": lambda: section_throughput(dsn, conn, args.rows, args.peer_rows, args.reps),
                "r": lambda: section_read_ahead(dsn, conn, args.rows, args.reps),
                "2": lambda: section_claimers(
                    dsn, conn, args.claimer_rows, args.claimer_batch, args.reps
                ),
                "p": lambda: section_processes(
                    dsn, conn, args.claimer_rows, args.reps, Ordering(args.ordering)
                ),
                "3": lambda: section_growth(
                    dsn, conn, args.grow_to, 100, flat=not args.no_flat_growth
                ),
                "4": lambda: section_xmin(dsn, conn, args.rows, args.xmin_seconds, 1000),
                "s": lambda: steady.section_steady(
                    dsn,
                    srv.tool("pg_recvlogical"),
                    args.steady_seconds,
                    [1000, 5000],
                    [RelayOptions().linger_s * 1000, 0.0],
                ),
                "l": lambda: steady.section_linger(
                    dsn, args.steady_seconds, [0.0, 1.0, 2.0, 5.0, 10.0]
                ),
                "k": lambda: steady.section_late(dsn, 20 if args.quick else 40),
                "t": lambda: steady.section_trigger(
                    dsn,
                    args.trigger_seconds,
                    [1, 4, 16] if args.quick else [1, 2, 4, 8, 16],
                    args.trigger_fsync,
                    args.reps,
                ),
            }
            for key in args.only:
                sections[key]()
                print(f"({steady.load_note()})")
    finally:
        srv.stop()
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
