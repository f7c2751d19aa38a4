"""Benchmark what writers lose while the HOPER swap waits for a session holding a lock it needs.

Goal (issue 13): with a conflicting lock held for 30 s during a swap, writers inserting at
200/s keep >= 95 % of their throughput and their p99 insert latency stays <= 2x their baseline.
The 0.1 runner did not: every attempt queued for ACCESS EXCLUSIVE under lock_timeout and stalled
every writer behind it for up to lock_timeout, attempt after attempt, for as long as the holder
stayed. Today's runner (`watch_blockers`, the default) watches a visible holder in pg_locks and
only attempts the lock once it is gone. Both are measured side by side in one run:

- `queueing`: `Runner.watch_blockers = False`, the 0.1 behaviour (attempt, queue, time out,
  back off, retry);
- `watching`: `Runner.watch_blockers = True`.

Method. The script starts its own PostgreSQL 18 (`outbox_migrate_harness.testing.server.start(18)`,
fsync off) and builds one seed database: the flat outbox with `SEED_PUBLISHED` published and
`SEED_UNPUBLISHED` unpublished rows. Each behaviour gets a clone of it (`CREATE DATABASE …
TEMPLATE`), taken through HOPER V2 and V3 by the real `Runner` (the script plays the
application in between: rows inserted into and published from outbox_new, the old table's rows
published so V3's gate opens; gate window 0.2 s). The next `run --to V4` ends with the swap,
which locks outbox_new, outbox_published and outbox in ACCESS EXCLUSIVE mode.

Writers: `WRITERS` processes (not threads: the runner's Python never delays their timings), each
inserting one row per statement into outbox_new on a fixed schedule of `RATE_PER_WRITER`/s,
staggered so the total is an even 200/s. A slot that passes while an insert is stalled is not
caught up: it is counted as scheduled but not done (an insert that ends up to half an interval
late is still issued, so scheduling jitter is not counted as loss). Every insert is timed. The
writers run with lock_timeout 0, as applications do: they wait as long as the runner makes them.

1. Baseline: the writers for `--baseline-s` (10 s) with nothing else running, after 1 s of
   warm-up: done/scheduled and p50/p99/max insert latency.
2. A blocker session runs `BEGIN; SELECT count(*) FROM outbox_published` and stays idle in
   transaction for `--hold-s` (30 s; `--quick`: 8 s), holding ACCESS SHARE on the published
   partition, which the swap needs in ACCESS EXCLUSIVE mode. Once it holds the lock,
   `Runner.run("V4")` starts (lock_timeout 200 ms, budget max(60 s, hold + 30 s)).
3. Window: from the start of that run to the end of the swap step (the runner's
   `step_finished` event). Throughput kept = (done/scheduled in the window) / (done/scheduled
   in the baseline); latencies of the inserts scheduled in the window against the baseline's.
   Also: the swap's duration, the ledger's attempts for the swap (`outbox_migrate.attempt`, by
   outcome: `lock_timeout` = an attempt that queued and timed out, `waiting` = a report that a
   visible holder is being watched, `done`), that the swap applied (outbox is the DEFAULT
   partition) and that every row a writer committed is in outbox_new.

With `--relay-ack-ms N` the real relay runs throughout too (`--relay-workers`, default 1),
its sink waiting N ms per batch for the broker's acknowledgement.

Usage: python bench/lock_wait.py [--hold-s 30] [--baseline-s 10] [--quick] [--format json]
       [--relay-ack-ms 5] [--relay-workers 1] [--only watching] [--pg 18]
The default run takes about 2 minutes, `--quick` under one. Exit status 1 when `watching`
misses a goal (the `queueing` figures are the comparison; they are expected to miss).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psycopg
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from psycopg import sql

from outbox_migrate.config import load_settings
from outbox_migrate.lock_budget import AttemptLog
from outbox_migrate.patterns.model import Step
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Mode, RelayOptions
from outbox_migrate.relay.sinks.stdout import StdoutSink
from outbox_migrate.relay.worker import Relay, running
from outbox_migrate.runner import Runner

WRITERS = 4
RATE_PER_WRITER = 50.0
"""Inserts per second per writer: 4 x 50 = 200/s in all."""
WARMUP_S = 1.0
BASELINE_S = 10.0
HOLD_S = 30.0
QUICK_HOLD_S = 8.0
QUICK_BASELINE_S = 5.0
LOCK_TIMEOUT_MS = 200
MIN_BUDGET_S = 60.0
GATE_WINDOW_S = 0.2
AFTER_RUN_S = 0.3
"""Writers keep going this long after the run, so inserts stalled by the swap complete."""
SEED_PUBLISHED = 10_000
SEED_UNPUBLISHED = 100
NEW_PUBLISHED = 1_000
"""Rows the application inserts into and publishes from outbox_new between V2 and V3."""
STALL_MS = 50.0
"""An insert at least this slow is counted as stalled."""
MAX_STALLS_LISTED = 200
GOAL_THROUGHPUT = 0.95
GOAL_P99_RATIO = 2.0
WRITER_APP = "lock-wait-writer"
BLOCKER_APP = "lock-wait-blocker"
APP_NAME = "lock-wait-app"
SWAP_STEP = "swap-default"
BEHAVIOURS = {"queueing": False, "watching": True}
"""Behaviour name -> `Runner.watch_blockers`."""


# -- writers ---------------------------------------------------------------------------------


def writer_process(dsn: str, number: int, rate: float, stop: Any, results: Any) -> None:
    """Insert one row into outbox_new at each slot `start_at + k / rate` (`start_at` comes
    from the parent once every writer is connected); a slot missed while an insert was stalled
    is skipped, not caught up. Sends back (slot, start, end) per insert."""
    conn = psycopg.connect(dsn, autocommit=True, application_name=WRITER_APP)
    conn.execute("SET lock_timeout = 0")
    conn.execute("SET statement_timeout = 0")
    statement = "INSERT INTO outbox_new (event_type, message_key, payload) VALUES ('event', %s, %s)"
    interval = 1.0 / rate
    grace = interval / 2
    slots, starts, ends, failed = array("d"), array("d"), array("d"), array("d")
    clock = time.perf_counter  # CLOCK_MONOTONIC: comparable between processes on Linux
    results.send("ready")
    start_at = float(results.recv())
    k = 0
    while not stop.is_set():
        slot = start_at + k * interval
        pause = slot - clock()
        if pause > 0:
            time.sleep(pause)
        started = clock()
        try:
            conn.execute(statement, (f"lw-{number}-{k}", json.dumps({"k": k})), prepare=True)
        except psycopg.Error:
            failed.append(slot)
        else:
            ended = clock()
            slots.append(slot)
            starts.append(started)
            ends.append(ended)
        # The next slot is the first one not already more than `grace` in the past.
        first_on_time = math.ceil((clock() - grace - start_at) / interval)
        k = max(k + 1, first_on_time)
    conn.close()
    results.send([a.tobytes() for a in (slots, starts, ends, failed)])
    results.close()


@dataclass
class WriterLog:
    start_at: float
    interval: float
    slots: array[float]
    starts: array[float]
    ends: array[float]
    failed: array[float]

    def scheduled(self, since: float, until: float) -> int:
        """Slots of this writer's schedule in [since, until)."""
        first = max(0, math.ceil((since - self.start_at) / self.interval))
        last = math.ceil((until - self.start_at) / self.interval)  # exclusive
        return max(0, last - first)


class Writers:
    """`WRITERS` writer processes on one database, staggered to an even total rate (and the
    relay in a process of its own when `relay_ack_s` is given)."""

    def __init__(self, dsn: str, relay_ack_s: float | None = None, relay_workers: int = 1) -> None:
        self.dsn = dsn
        self.relay_ack_s = relay_ack_s
        self.relay_workers = relay_workers
        self.relay: tuple[Any, Any] | None = None
        self.relay_published = 0
        self.context = mp.get_context("spawn")
        self.stop_flag = self.context.Event()
        self.processes: list[tuple[Any, Any, float]] = []
        self.logs: list[WriterLog] = []
        self.started_at = 0.0

    def __enter__(self) -> Writers:
        for number in range(WRITERS):
            mine, theirs = self.context.Pipe()
            process = self.context.Process(
                target=writer_process,
                args=(self.dsn, number, RATE_PER_WRITER, self.stop_flag, theirs),
                name=f"writer-{number}", daemon=True,
            )  # fmt: skip
            process.start()
            theirs.close()
            self.processes.append((process, mine, 0.0))
        if self.relay_ack_s is not None:
            mine, theirs = self.context.Pipe()
            process = self.context.Process(
                target=relay_process,
                args=(self.dsn, self.relay_ack_s, self.relay_workers, self.stop_flag, theirs),
                name="relay", daemon=True,
            )  # fmt: skip
            process.start()
            theirs.close()
            self.relay = (process, mine)
            mine.recv()
        for _process, pipe, _ in self.processes:
            pipe.recv()  # connected
        # One schedule for all, staggered so that the total rate is even.
        self.started_at = time.perf_counter() + 0.1
        for number, (process, pipe, _) in enumerate(self.processes):
            start_at = self.started_at + number / (RATE_PER_WRITER * WRITERS)
            pipe.send(start_at)
            self.processes[number] = (process, pipe, start_at)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_flag.set()
        for process, pipe, start_at in self.processes:
            raw = pipe.recv()
            process.join(timeout=60)
            slots, starts, ends, failed = (array("d", chunk) for chunk in raw)
            self.logs.append(
                WriterLog(start_at, 1.0 / RATE_PER_WRITER, slots, starts, ends, failed)
            )
        if self.relay is not None:
            process, pipe = self.relay
            self.relay_published = int(pipe.recv())
            process.join(timeout=60)

    def sleep_until(self, at: float) -> None:
        time.sleep(max(0.0, at - time.perf_counter()))

    def window(self, since: float, until: float) -> WindowStats:
        scheduled = sum(log.scheduled(since, until) for log in self.logs)
        calls = [
            (start, (end - start) * 1000)
            for log in self.logs
            for slot, start, end in zip(log.slots, log.starts, log.ends, strict=True)
            if since <= slot < until
        ]
        failed = sum(1 for log in self.logs for slot in log.failed if since <= slot < until)
        stalls = sorted((start - since, ms) for start, ms in calls if ms >= STALL_MS)
        return WindowStats(
            until - since, scheduled, len(calls), failed, [ms for _, ms in calls], stalls
        )

    def committed(self) -> int:
        return sum(len(log.slots) for log in self.logs)


@dataclass
class WindowStats:
    seconds: float
    scheduled: int
    done: int
    failed: int
    latencies_ms: list[float] = field(repr=False)
    stalls: list[tuple[float, float]] = field(default_factory=list)
    """(seconds into the window the insert started, its milliseconds), for stalled inserts."""

    @property
    def done_share(self) -> float:
        return self.done / self.scheduled if self.scheduled else 0.0

    def quantile(self, q: float) -> float:
        if not self.latencies_ms:
            return 0.0
        if len(self.latencies_ms) < 2:
            return self.latencies_ms[0]
        return statistics.quantiles(self.latencies_ms, n=1000, method="inclusive")[
            round(q * 1000) - 1
        ]

    @property
    def stalled(self) -> int:
        return len(self.stalls)

    def summary(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 2),
            "scheduled": self.scheduled,
            "done": self.done,
            "failed": self.failed,
            "done_share": round(self.done_share, 4),
            "rate_per_s": round(self.done / self.seconds, 1) if self.seconds else 0.0,
            "p50_ms": round(self.quantile(0.5), 2),
            "p99_ms": round(self.quantile(0.99), 2),
            "max_ms": round(max(self.latencies_ms, default=0.0), 2),
            "stalled": self.stalled,
            "stalls": [[round(at, 3), round(ms, 1)] for at, ms in self.stalls[:MAX_STALLS_LISTED]],
        }


# -- the relay (optional) -------------------------------------------------------------------


RELAY_BATCH = 100
RELAY_POLL_S = 0.05


class AckLatencySink(StdoutSink):
    """The stdout sink into /dev/null plus a fixed wait per batch: a broker's acknowledgement
    round trip, during which the relay's batch transaction stays open (its locks held)."""

    def __init__(self, stream: TextIO, latency_s: float) -> None:
        super().__init__(stream=stream)
        self.latency_s = latency_s

    def publish(self, batch: Sequence[Message]) -> None:
        super().publish(batch)
        time.sleep(self.latency_s)


def relay_process(dsn: str, ack_s: float, workers: int, stop: Any, results: Any) -> None:
    """The real relay (partitioned mode, polling every `RELAY_POLL_S`) publishing what the
    writers insert, in its own process. Each batch is one transaction held open for the ack:
    it claims from outbox_unpublished (ROW SHARE on that partition only, which the swap does
    not lock) and marks through outbox_new (ROW EXCLUSIVE on it and outbox_published, from the
    mark to the commit): the holders the watching runner sees from the relay."""
    with Path(os.devnull).open("w") as devnull:
        relay = Relay(
            dsn,
            lambda: AckLatencySink(devnull, ack_s),
            options=RelayOptions(
                mode=Mode.partitioned, batch_size=RELAY_BATCH, poll_interval_s=RELAY_POLL_S,
                listen=False, workers=workers,
            ),
        )  # fmt: skip
        with running(relay):
            results.send("ready")
            stop.wait()
            relay.stop()
    results.send(relay.stats.published)
    results.close()


# -- the blocker and the runner's events -----------------------------------------------------


class Blocker(threading.Thread):
    """A session idle in transaction after reading the published partition (ACCESS SHARE on
    it) for `hold_s`, like a report or a forgotten psql. A thread is enough: its timing only
    decides when the lock goes, nothing here is measured from it."""

    def __init__(self, dsn: str, hold_s: float, relation: str) -> None:
        super().__init__(name="blocker", daemon=True)
        self.dsn, self.hold_s, self.relation = dsn, hold_s, relation
        self.holding = threading.Event()
        self.acquired_at = 0.0
        self.released_at = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, application_name=BLOCKER_APP) as conn:
                conn.execute(
                    sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(self.relation))
                )
                self.acquired_at = time.perf_counter()
                self.holding.set()
                time.sleep(self.hold_s)
                conn.rollback()
                self.released_at = time.perf_counter()
        except BaseException as exc:
            self.error = exc
            self.holding.set()


class Timeline:
    """`RunnerEvents`: when the swap step starts and finishes; warnings to stderr."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.swap_started = 0.0
        self.swap_finished = 0.0
        self.attempt_events = 0

    def step_started(self, step: Step, action: str) -> None:
        if step.kind == SWAP_STEP:
            self.swap_started = time.perf_counter()

    def attempt(self, step: Step, log: AttemptLog) -> None:
        if step.kind == SWAP_STEP:
            self.attempt_events += 1

    def step_finished(self, step: Step, outcome: str, elapsed_s: float) -> None:
        if step.kind == SWAP_STEP:
            self.swap_finished = time.perf_counter()

    def warning(self, step: Step, message: str) -> None:
        print(f"  warning in {step.id}: {message}", file=self.out)

    def progress(self, step: Step, done: int, total: int, rate_per_s: float) -> None:
        return None


# -- databases -------------------------------------------------------------------------------


def admin_execute(srv: pgserver.Server, statement: sql.Composed) -> None:
    with psycopg.connect(srv.dsn(), autocommit=True) as admin:
        admin.execute(statement)


def create_seed(dsn: str) -> None:
    """The flat outbox at V1: published rows and a few unpublished ones."""
    with psycopg.connect(dsn, autocommit=True, application_name=APP_NAME) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", SEED_PUBLISHED, published=True)
        insert_rows(conn, "outbox", SEED_UNPUBLISHED, published=False)
        conn.execute("VACUUM (ANALYZE) outbox")


def clone(srv: pgserver.Server, seed: str, name: str) -> str:
    ident = sql.Identifier
    admin_execute(srv, sql.SQL("DROP DATABASE IF EXISTS {}").format(ident(name)))
    admin_execute(
        srv,
        sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY FILE_COPY").format(
            ident(name), ident(seed)
        ),
    )
    return name


def drop(srv: pgserver.Server, name: str) -> None:
    admin_execute(
        srv, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    )


def settings_for(hold_s: float) -> Any:
    return load_settings(
        {
            "gate_window_s": GATE_WINDOW_S,
            "lock_timeout_ms": LOCK_TIMEOUT_MS,
            "lock_budget_s": max(MIN_BUDGET_S, hold_s + 30.0),
        }
    )


def prepare_v3(dsn: str, hold_s: float) -> None:
    """HOPER V2 and V3 through the runner, playing the application in between: V2 inserts
    into and publishes from outbox_new (rows in outbox_published for the blocker to read) and
    drains the old table, so V3's gate opens."""
    with Runner(dsn, settings_for(hold_s), "hoper") as runner:
        runner.run("V2")
        with psycopg.connect(dsn, autocommit=True, application_name=APP_NAME) as app:
            insert_rows(app, "outbox_new", NEW_PUBLISHED, published=True)
            app.execute("UPDATE outbox SET published_at = now() WHERE published_at IS NULL")
        runner.run("V3")


# -- one behaviour ---------------------------------------------------------------------------


@dataclass
class Result:
    behaviour: str
    watch_blockers: bool
    hold_s: float
    baseline: WindowStats
    during: WindowStats
    run_to_swap_s: float
    swap_step_s: float
    blocker_released_after_s: float
    attempts: dict[str, int]
    swap_applied: bool
    rows_missing: int
    phase: str
    relay_ack_ms: float | None = None
    relay_published: int = 0
    holders: dict[str, int] = field(default_factory=dict)

    @property
    def throughput_kept(self) -> float:
        base = self.baseline.done_share
        return self.during.done_share / base if base else 0.0

    @property
    def p99_ratio(self) -> float:
        base = self.baseline.quantile(0.99)
        return self.during.quantile(0.99) / base if base else math.inf

    @property
    def throughput_goal_met(self) -> bool:
        return self.throughput_kept >= GOAL_THROUGHPUT

    @property
    def p99_goal_met(self) -> bool:
        return self.p99_ratio <= GOAL_P99_RATIO

    def summary(self) -> dict[str, Any]:
        return {
            "behaviour": self.behaviour,
            "watch_blockers": self.watch_blockers,
            "hold_s": self.hold_s,
            "baseline": self.baseline.summary(),
            "during": self.during.summary(),
            "throughput_kept": round(self.throughput_kept, 4),
            "p99_ratio": round(self.p99_ratio, 2),
            "run_to_swap_s": round(self.run_to_swap_s, 2),
            "swap_step_s": round(self.swap_step_s, 2),
            "blocker_released_after_s": round(self.blocker_released_after_s, 2),
            "swap_attempts": self.attempts,
            "holders_in_attempts": self.holders,
            "swap_applied": self.swap_applied,
            "phase": self.phase,
            "rows_missing": self.rows_missing,
            "stalled_after_release": sum(
                1 for at, _ in self.during.stalls if at >= self.blocker_released_after_s
            ),
            "relay_ack_ms": self.relay_ack_ms,
            "relay_published": self.relay_published,
            "throughput_goal_met": self.throughput_goal_met,
            "p99_goal_met": self.p99_goal_met,
        }


def swap_attempts(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """The ledger's attempt rows of the swap step, by outcome."""
    rows = conn.execute(
        "SELECT a.outcome, count(*) FROM outbox_migrate.attempt a "
        "JOIN outbox_migrate.migration m ON m.id = a.migration_id "
        "WHERE m.pattern = 'hoper' AND a.step_id LIKE %s GROUP BY a.outcome ORDER BY 1",
        (f"%{SWAP_STEP}",),
    ).fetchall()
    return {str(outcome): int(count) for outcome, count in rows}


def swap_holders(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """application_name -> number of the swap's attempt rows naming that session as a holder
    (the blocker, but also writers or the relay caught mid-transaction)."""
    rows = conn.execute(
        "SELECT coalesce(nullif(b->>'application_name', ''), '(none)'), count(*) "
        "FROM outbox_migrate.attempt a "
        "JOIN outbox_migrate.migration m ON m.id = a.migration_id "
        "CROSS JOIN LATERAL jsonb_array_elements(a.blockers) b "
        "WHERE m.pattern = 'hoper' AND a.step_id LIKE %s GROUP BY 1 ORDER BY 2 DESC, 1",
        (f"%{SWAP_STEP}",),
    ).fetchall()
    return {str(app): int(count) for app, count in rows}


def outbox_is_default_partition(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(
        "SELECT c.relispartition AND pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT' "
        "AND i.inhparent = 'outbox_new'::regclass "
        "FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid "
        "WHERE c.oid = 'outbox'::regclass"
    ).fetchone()
    return bool(row and row[0])


def rows_present(conn: psycopg.Connection[Any]) -> int:
    """The writers' rows in outbox_new, plus those the relay published before the swap, which
    stay in the detached outbox_published."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM outbox_new WHERE message_key LIKE 'lw-%') "
        "+ (SELECT count(*) FROM outbox_published WHERE message_key LIKE 'lw-%')"
    ).fetchone()
    return int(row[0]) if row else 0


def measure(
    dsn: str,
    behaviour: str,
    *,
    hold_s: float,
    baseline_s: float,
    relay_ack_ms: float | None = None,
    relay_workers: int = 1,
    out: Any = sys.stderr,
) -> Result:
    """On a database at HOPER V3 (`prepare_v3`): writers' baseline, then `run --to V4` with
    the blocker holding its lock for `hold_s`; the writers measured up to the end of the swap."""
    watch = BEHAVIOURS[behaviour]
    timeline = Timeline(out)
    settings = settings_for(hold_s)
    relay_ack_s = relay_ack_ms / 1000 if relay_ack_ms is not None else None
    with Writers(dsn, relay_ack_s, relay_workers) as writers:
        baseline_from = writers.started_at + WARMUP_S
        baseline_to = baseline_from + baseline_s
        writers.sleep_until(baseline_to)
        blocker = Blocker(dsn, hold_s, settings.spec.published_partition)
        with Runner(dsn, settings, "hoper", events=timeline) as runner:
            runner.watch_blockers = watch
            blocker.start()
            blocker.holding.wait()
            if blocker.error is not None:
                raise RuntimeError(f"the blocker could not take its lock: {blocker.error}")
            run_started = time.perf_counter()
            print(f"  [{behaviour}] blocker holds its lock; run --to V4", file=out)
            result = runner.run("V4")
            run_ended = time.perf_counter()
            phase = result.phase
        blocker.join(timeout=hold_s + 10)
        writers.sleep_until(run_ended + AFTER_RUN_S)
    swap_end = timeline.swap_finished or run_ended
    baseline = writers.window(baseline_from, baseline_to)
    during = writers.window(run_started, swap_end)
    with psycopg.connect(dsn, autocommit=True) as conn:
        attempts = swap_attempts(conn)
        holders = swap_holders(conn)
        applied = outbox_is_default_partition(conn)
        present = rows_present(conn)
    return Result(
        behaviour=behaviour,
        watch_blockers=watch,
        hold_s=hold_s,
        baseline=baseline,
        during=during,
        run_to_swap_s=swap_end - run_started,
        swap_step_s=(timeline.swap_finished - timeline.swap_started)
        if timeline.swap_finished
        else 0.0,
        blocker_released_after_s=(blocker.released_at - run_started) if blocker.released_at else 0,
        attempts=attempts,
        swap_applied=applied,
        rows_missing=writers.committed() - present,
        phase=phase,
        relay_ack_ms=relay_ack_ms,
        relay_published=writers.relay_published,
        holders=holders,
    )


# -- report ----------------------------------------------------------------------------------


def summarise(
    results: list[Result],
    version: str,
    hold_s: float,
    relay_ack_ms: float | None = None,
    relay_workers: int = 1,
) -> dict[str, Any]:
    watching = next((r for r in results if r.watch_blockers), None)
    return {
        "postgres": version,
        "setup": {
            "writers": WRITERS,
            "rate_per_s": WRITERS * RATE_PER_WRITER,
            "hold_s": hold_s,
            "blocker": "idle in transaction after SELECT count(*) FROM outbox_published",
            "lock_timeout_ms": LOCK_TIMEOUT_MS,
            "budget_s": max(MIN_BUDGET_S, hold_s + 30.0),
            "relay_ack_ms": relay_ack_ms,
            "relay_workers": relay_workers if relay_ack_ms is not None else 0,
        },
        "goal": {"min_throughput_kept": GOAL_THROUGHPUT, "max_p99_ratio": GOAL_P99_RATIO},
        "behaviours": {r.behaviour: r.summary() for r in results},
        "goal_met": bool(
            watching
            and watching.throughput_goal_met
            and watching.p99_goal_met
            and watching.swap_applied
            and watching.rows_missing == 0
        ),
    }


def print_table(summary: dict[str, Any]) -> None:
    setup = summary["setup"]
    rows = summary["behaviours"]
    names = list(rows)
    print(
        f"Writers during a HOPER swap that waits {setup['hold_s']:.0f} s for a blocker, "
        f"PostgreSQL {summary['postgres']}.\n{setup['writers']} writers, "
        f"{setup['rate_per_s']:.0f} inserts/s into outbox_new; blocker: {setup['blocker']}; "
        f"lock_timeout {setup['lock_timeout_ms']} ms, budget {setup['budget_s']:.0f} s.\n"
        "Window: from the start of `run --to V4` to the end of the swap."
    )
    if setup["relay_ack_ms"] is not None:
        print(
            f"The relay runs throughout ({setup['relay_workers']} worker(s), partitioned mode, "
            f"batch {RELAY_BATCH}, polling every "
            f"{RELAY_POLL_S * 1000:.0f} ms, {setup['relay_ack_ms']:g} ms per broker ack)."
        )

    def line(label: str, cells: list[str]) -> None:
        print(f"{label:<40}" + "".join(f"{cell:>24}" for cell in cells))

    def counts(part: dict[str, Any]) -> str:
        return f"{part['done']:,}/{part['scheduled']:,} ({part['done_share'] * 100:.1f} %)"

    def latencies(part: dict[str, Any]) -> str:
        return f"{part['p50_ms']:.1f} / {part['p99_ms']:.1f} / {part['max_ms']:.0f}"

    def pct(share: float) -> str:
        return f"{share * 100:.1f} %"

    def holders(r: dict[str, Any]) -> str:
        def short(app: str) -> str:
            names = {BLOCKER_APP: "blocker", WRITER_APP: "writers"}
            return "relay" if "relay" in app else names.get(app, app)

        named = r["holders_in_attempts"].items()
        return ", ".join(f"{short(k)} {v}" for k, v in named) or "-"

    def attempts(r: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v}" for k, v in r["swap_attempts"].items()) or "-"

    table: list[tuple[str, Any]] = [
        ("baseline: done/scheduled", lambda r: counts(r["baseline"])),
        ("baseline: insert p50 / p99 / max ms", lambda r: latencies(r["baseline"])),
        ("during: done/scheduled", lambda r: counts(r["during"])),
        ("during: insert p50 / p99 / max ms", lambda r: latencies(r["during"])),
        (
            f"during: inserts >= {STALL_MS:.0f} ms (after release)",
            lambda r: f"{r['during']['stalled']} ({r['stalled_after_release']})",
        ),
        ("throughput kept (vs baseline)", lambda r: pct(r["throughput_kept"])),
        ("p99 vs baseline", lambda r: f"{r['p99_ratio']:.2f}x"),
        ("run start -> swap done s", lambda r: f"{r['run_to_swap_s']:.2f}"),
        ("blocker released after s", lambda r: f"{r['blocker_released_after_s']:.2f}"),
        ("swap attempts in the ledger", attempts),
        ("holders named (attempt rows)", holders),
        ("swap applied; rows missing", lambda r: f"{r['swap_applied']}; {r['rows_missing']}"),
    ]
    if setup["relay_ack_ms"] is not None:
        table.append(("relay: rows published", lambda r: f"{r['relay_published']:,}"))
    line("", [f"{n} (watch={rows[n]['watch_blockers']})" for n in names])
    print("-" * (40 + 24 * len(names)))
    for label, cell in table:
        line(label, [cell(rows[n]) for n in names])
    print()
    goal = summary["goal"]
    for n in names:
        r = rows[n]
        met = (
            "met" if r["throughput_goal_met"] else "missed",
            "met" if r["p99_goal_met"] else "missed",
        )
        print(
            f"{n}: throughput kept {pct(r['throughput_kept'])} (goal >= "
            f"{pct(goal['min_throughput_kept'])}: {met[0]}), p99 {r['p99_ratio']:.2f}x baseline "
            f"(goal <= {goal['max_p99_ratio']:.0f}x: {met[1]})"
        )
    print(f"goal met by the watching runner: {summary['goal_met']}")


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hold-s", type=float, default=None, help=f"default {HOLD_S:.0f}")
    parser.add_argument("--baseline-s", type=float, default=None, help=f"default {BASELINE_S:.0f}")
    parser.add_argument(
        "--quick", action="store_true",
        help=f"hold {QUICK_HOLD_S:.0f} s, baseline {QUICK_BASELINE_S:.0f} s (CI smoke run)",
    )  # fmt: skip
    parser.add_argument(
        "--relay-ack-ms", type=float, default=None,
        help="also run the real relay, with this broker ack latency per batch",
    )  # fmt: skip
    parser.add_argument("--relay-workers", type=int, default=1)
    parser.add_argument("--only", choices=tuple(BEHAVIOURS), default=None)
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--pg", type=int, default=18)
    args = parser.parse_args(argv)
    hold_s = args.hold_s or (QUICK_HOLD_S if args.quick else HOLD_S)
    baseline_s = args.baseline_s or (QUICK_BASELINE_S if args.quick else BASELINE_S)
    behaviours = [args.only] if args.only else list(BEHAVIOURS)
    srv = pgserver.start(args.pg)
    try:
        seed = "lock_wait_seed"
        drop(srv, seed)
        admin_execute(srv, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(seed)))
        create_seed(srv.dsn(seed))
        results = []
        for behaviour in behaviours:
            name = clone(srv, seed, f"lock_wait_{behaviour}")
            began = time.monotonic()
            prepare_v3(srv.dsn(name), hold_s)
            result = measure(
                srv.dsn(name), behaviour, hold_s=hold_s, baseline_s=baseline_s,
                relay_ack_ms=args.relay_ack_ms, relay_workers=args.relay_workers,
            )  # fmt: skip
            results.append(result)
            print(f"[{behaviour}] measured in {time.monotonic() - began:.0f} s", file=sys.stderr)
            drop(srv, name)
        summary = summarise(
            results, srv.full_version, hold_s, args.relay_ack_ms, args.relay_workers
        )
    finally:
        srv.stop()
    if args.format == "json":
        print(json.dumps(summary, indent=2))
    else:
        print_table(summary)
    watching = summary["behaviours"].get("watching")
    if watching is None:
        return 0
    return 0 if summary["goal_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
