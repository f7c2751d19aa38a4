"""Steady-state sections of bench/relay.py: latency and relay CPU under paced plain INSERTs,
beside the CDC floor; the wake-up trigger's cost to the application's commits; linger.

* steady (`--only s`): writer *processes* insert one row per autocommit transaction through the
  partitioned parent (plain INSERT, no pg_notify: the wake-up trigger does the waking), paced
  to a total rate. The relay runs in its own process (stdout sink into /dev/null) with the
  default linger and with none, and records when each id reached the sink; end-to-end = that
  moment minus the moment the writer's COMMIT returned (CLOCK_MONOTONIC is one clock for all
  processes). Relay CPU = the relay process's user+system time over the paced window, per
  100 k messages. Just before, under the same writers, pg_recvlogical (test_decoding, a
  logical slot) streams the inserts alone: the CDC floor, the latency of a reader of the WAL.
  Alone, because run at the same time each one's CPU inflated the other's tail on 2 vCPUs.
* trigger (`--only t`): closed-loop writers (1..16 processes, INSERT+COMMIT as fast as they
  can) with no trigger, with the relay's idle-aware trigger, and with a naive trigger that
  notifies on every statement — each with the relay running, measured one after the other
  in the same run; insert throughput and commit p99. Run with fsync and synchronous_commit
  on: the NOTIFY lock is held across the commit's WAL flush, which is where it hurts.
* linger (`--only l`): the steady section at 1,000 msg/s for several `--linger-ms` values.
* late rows (`--only k`): a row committed after a higher id was published, delivered how long
  after its COMMIT — traffic stopped, and under 1,000 msg/s beside that traffic's own
  end-to-end, with one relay in the same run.
* builds side by side (`python bench/relay_steady.py --compare a61c2dd 5326c35 .`): the
  steady section's relay, one build at a time, interleaved (A, B, C, A, B, C, …) on one
  throwaway PostgreSQL 18 under the same paced writers. A build is a commit, extracted with
  `git archive` into a temporary directory, or `.` for the code this file sits beside; each
  run's relay is a process of its own that imports that build's package (this file with
  `--child`, the build first on PYTHONPATH) and installs that build's wake-up trigger, so each
  relay is measured as it was released. `--together`: the builds at the same time instead,
  each on a database of its own under writers of its own (the databases swapped round by
  round), so a drift of the machine between runs falls on every build alike; the summary
  prints each round's ratio to the first build's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.options import RelayOptions
from outbox_migrate.relay.sinks.stdout import StdoutSink
from outbox_migrate.relay.worker import Relay, running

SPEC = OutboxSpec()


def _wake_up_trigger() -> tuple[Any, str]:
    """The wake-up trigger's module and default channel of whichever build is imported: a
    `--child` may run a build from before the trigger's DDL moved to the patterns."""
    try:
        from outbox_migrate.patterns import notify
    except ImportError:
        from outbox_migrate.relay import notify  # type: ignore[no-redef,attr-defined]
    return notify, RelayOptions().channel


INSERT = (
    "INSERT INTO outbox_new (payload, event_type, message_key) "
    "VALUES ('{\"order\": 42, \"pad\": \"xxxxxxxxxxxxxxxx\"}', 'OrderCreated', 'k') RETURNING id"
)
WARM_UP_S = 1.0
DRAIN_WAIT_S = 3.0
SLOT = "bench_cdc"
CDC_ID = re.compile(rb"^table \S+: INSERT: id\[bigint\]:(\d+)", re.MULTILINE)


# -- processes ---------------------------------------------------------------------------------


class _RecordingSink(StdoutSink):
    """The stdout sink (into /dev/null) that also notes when each id reached it."""

    def __init__(self, stream: Any, seen: list[tuple[int, float]]) -> None:
        super().__init__(stream=stream)
        self.seen = seen

    def publish(self, batch: Any) -> None:
        super().publish(batch)
        now = time.monotonic()
        self.seen.extend((m.id, now) for m in batch)


def _relay_child(dsn: str, linger_s: float, ready: Any, begin: Any, end: Any, out: Any) -> None:
    """A relay process: records deliveries; CPU between `begin` and `end`."""
    seen: list[tuple[int, float]] = []
    with Path(os.devnull).open("w") as devnull:
        relay = Relay(
            dsn,
            lambda: _RecordingSink(devnull, seen),
            spec=SPEC,
            options=RelayOptions(linger_s=linger_s),
        )
        with running(relay):
            time.sleep(WARM_UP_S)
            ready.set()
            begin.wait()
            cpu0, wakes0 = sum(os.times()[:2]), _wakes()
            end.wait()
            cpu, wakes = sum(os.times()[:2]) - cpu0, _wakes() - wakes0
            time.sleep(DRAIN_WAIT_S)
            batches = relay.stats.batches
    out.put((cpu, seen, batches, wakes))


def _wakes() -> int:
    """This process's voluntary context switches, all threads: its sleeps, so its wake-ups
    (CPU per message follows wake-ups per message more than anything else)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def _writer_child(dsn: str, rate: float, seconds: float, ready: Any, go: Any, out: Any) -> None:
    """Paced writer: one autocommit INSERT every 1/rate s from the start time it is sent."""
    committed: list[tuple[int, float]] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")
        ready.release()
        start_at = go.get()
        interval = 1.0 / rate
        n = int(rate * seconds)
        delay = start_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for i in range(n):
            due = start_at + i * interval
            ahead = due - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
            row = conn.execute(INSERT).fetchone()
            committed.append((int(row[0]) if row else 0, time.monotonic()))
    out.put(committed)


def _closed_writer(dsn: str, seconds: float, ready: Any, go: Any, out: Any) -> None:
    """Closed-loop writer: INSERT+COMMIT as fast as possible; commit latencies."""
    latencies: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")
        ready.release()
        start_at = go.get()
        delay = start_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        stop = start_at + seconds
        while (now := time.monotonic()) < stop:
            conn.execute(INSERT)
            latencies.append(time.monotonic() - now)
    out.put(latencies)


def _start_together(children: list[Any], ready: Any, go: Any, spread_s: float = 0.0) -> float:
    """Start writer processes, wait until each is connected, give them their start times:
    one start, each writer `spread_s` after the one before (returns the first)."""
    for child in children:
        child.start()
    for _ in children:
        ready.acquire(timeout=120)
    start_at = time.monotonic() + 0.2
    for k in range(len(children)):
        go.put(start_at + k * spread_s)
    return start_at


class _Cdc:
    """pg_recvlogical with test_decoding: when each inserted id arrived (the CDC floor)."""

    def __init__(self, tool: str, dsn: str) -> None:
        self.tool, self.dsn = tool, dsn
        self.seen: dict[int, float] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self.thread: threading.Thread | None = None

    def __enter__(self) -> _Cdc:
        subprocess.run(
            [self.tool, "-d", self.dsn, "--slot", SLOT, "--create-slot", "-P", "test_decoding"],
            check=True, capture_output=True,
        )  # fmt: skip
        self.process = subprocess.Popen(
            [self.tool, "-d", self.dsn, "--slot", SLOT, "--start", "-f", "-",
             "-o", "include-xids=0", "--status-interval", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        """Whatever the pipe holds in one `os.read`, stamped once, ids found in one pass: a
        line-by-line reader fell behind pg_recvlogical's unbuffered writes (three lines per
        transaction) and measured itself, not the floor (p50 8 ms; bench/cdc.py's reader)."""
        assert self.process is not None and self.process.stdout is not None
        fd, seen, tail = self.process.stdout.fileno(), self.seen, b""
        while chunk := os.read(fd, 1 << 20):
            now = time.monotonic()
            cut = chunk.rfind(b"\n") + 1  # a line split across reads waits for its end
            if not cut:
                tail += chunk
                continue
            text, tail = tail + chunk[:cut], chunk[cut:]
            for found in CDC_ID.finditer(text):
                seen.setdefault(int(found.group(1)), now)

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
        if self.thread is not None:
            self.thread.join(5)
        subprocess.run(
            [self.tool, "-d", self.dsn, "--slot", SLOT, "--drop-slot"], check=False,
            capture_output=True,
        )  # fmt: skip


# -- figures -------------------------------------------------------------------------------


@dataclass
class Latency:
    p50: float
    p99: float
    max: float
    missing: int

    @staticmethod
    def of(committed: dict[int, float], seen: dict[int, float]) -> Latency:
        delays = [seen[i] - t for i, t in committed.items() if i in seen]
        missing = sum(1 for i in committed if i not in seen)
        if not delays:
            return Latency(float("nan"), float("nan"), float("nan"), missing)
        delays.sort()
        return Latency(
            delays[len(delays) // 2] * 1000,
            delays[min(len(delays) - 1, int(len(delays) * 0.99))] * 1000,
            delays[-1] * 1000,
            missing,
        )

    def text(self) -> str:
        return f"{self.p50:6.2f} {self.p99:7.2f} {self.max:7.1f}"


@dataclass
class SteadyResult:
    rate: float
    writers: int
    relay: Latency
    cdc: Latency | None
    cpu_per_100k: float
    rows_per_batch: float
    messages: int
    wakes_per_msg: float
    traced: dict[str, Any] | None = None
    """`--trace`: Python lines and calls per batch (`_LineCounter.report`)."""


def _paced(
    dsn: str, rate: float, writers: int, seconds: float, begin: Any = None
) -> dict[int, float]:
    """Run `writers` paced writer processes for `seconds` at `rate` in total; when each id's
    COMMIT returned. `begin` (an Event) is set when they start."""
    ctx = multiprocessing.get_context("spawn")
    wout, wready, go = ctx.Queue(), ctx.Semaphore(0), ctx.Queue()
    children = [
        ctx.Process(target=_writer_child, args=(dsn, rate / writers, seconds, wready, go, wout))
        for _ in range(writers)
    ]
    # Interleaved, not in step: writer k starts k/rate after the first, so the rows arrive
    # one every 1/rate s, as `rate` suggests. Started together (as this did before) the
    # writers committed in bursts of `writers` rows at rate/writers per second, which a
    # batching consumer pays for once per burst: the relay's CPU per message at 1,000 msg/s
    # from 4 writers read about half of what evenly spaced rows cost (docs/relay.md).
    start_at = _start_together(children, wready, go, spread_s=1.0 / rate)
    time.sleep(max(0.0, start_at - time.monotonic()))
    if begin is not None:
        begin.set()
    committed: dict[int, float] = {}
    for _ in children:
        committed.update(wout.get(timeout=seconds + 120))
    for child in children:
        child.join(30)
    return committed


def cdc_run(dsn: str, tool: str, rate: float, writers: int, seconds: float) -> Latency:
    """The CDC floor alone: pg_recvlogical + test_decoding under the same paced writers, with
    no relay running (measured concurrently, each one's CPU on 2 vCPUs inflated the other's
    latency: at 5,000 msg/s beside a relay with no linger the floor's p99 read 38-67 ms)."""
    with _Cdc(tool, dsn) as cdc:
        time.sleep(0.5)
        committed = _paced(dsn, rate, writers, seconds)
        deadline = time.monotonic() + DRAIN_WAIT_S
        while len(cdc.seen) < len(committed) and time.monotonic() < deadline:
            time.sleep(0.05)
    return Latency.of(committed, cdc.seen)


def steady_run(
    dsn: str, tool: str | None, rate: float, writers: int, seconds: float, linger_s: float
) -> SteadyResult:
    """The relay (its own process) under paced writers; with `tool`, pg_recvlogical streams
    the same rows at the same time (section 5 measures the floor alone instead: `cdc_run`)."""
    ctx = multiprocessing.get_context("spawn")
    out, ready, begin, end = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    relay = ctx.Process(target=_relay_child, args=(dsn, linger_s, ready, begin, end, out))
    relay.start()
    ready.wait(60)
    cdc = _Cdc(tool, dsn) if tool else None
    try:
        if cdc is not None:
            cdc.__enter__()
            time.sleep(0.5)
        committed = _paced(dsn, rate, writers, seconds, begin)
        end.set()
        cpu, seen_list, batches, wakes = out.get(timeout=120)
        relay.join(30)
        time.sleep(0.2)
    finally:
        if cdc is not None:
            cdc.__exit__(None, None, None)
        if relay.is_alive():
            relay.terminate()
    seen = dict(seen_list)
    n = len(committed)
    return SteadyResult(
        rate=rate,
        writers=writers,
        relay=Latency.of(committed, seen),
        cdc=Latency.of(committed, cdc.seen) if cdc is not None else None,
        cpu_per_100k=cpu * 100_000 / max(1, n),
        rows_per_batch=len(seen) / max(1, batches),
        messages=n,
        wakes_per_msg=wakes / max(1, n),
    )


def _prepare(dsn: str, *, trigger: bool = True) -> None:
    """An empty outbox; the wake-up trigger installed, or none (the relay installs its own)."""
    notify, channel = _wake_up_trigger()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox_new")
        if trigger:
            notify.install(conn, SPEC, channel)
        else:
            for statement in notify.drop_sql(SPEC):
                conn.execute(statement)
        conn.execute("VACUUM ANALYZE outbox_new")


def section_steady(
    dsn: str, tool: str, seconds: float, rates: list[int], lingers_ms: list[float]
) -> None:
    default_ms = RelayOptions().linger_s * 1000
    print(f"\n## 5. Steady state: plain INSERTs (no pg_notify by the app; the wake-up trigger), "
          f"{seconds:.0f} s per row; linger (ms) in column 3, default {default_ms:g}")  # fmt: skip
    print("end-to-end = writer's COMMIT returned -> message in the relay's sink (ms); CDC = "
          "pg_recvlogical + test_decoding under the same writers just before, alone")  # fmt: skip
    print(f"{'msg/s':>6} {'writers':>7} {'linger':>6} | {'relay p50':>9} {'p99':>7} {'max':>7} | "
          f"{'CDC p50':>7} {'p99':>7} {'max':>7} | {'p99/CDC':>7} {'CPU-s/100k':>10} "
          f"{'rows/batch':>10} {'wakes/msg':>9} {'lost':>4}")  # fmt: skip
    for rate in rates:
        for writers in (1, 4):
            _prepare(dsn)
            cdc = cdc_run(dsn, tool, rate, writers, seconds)
            for linger in lingers_ms:
                _prepare(dsn)
                r = steady_run(dsn, None, rate, writers, seconds, linger / 1000)
                ratio = r.relay.p99 / cdc.p99 if cdc.p99 > 0 else float("nan")
                print(f"{rate:>6} {writers:>7} {linger:>6g} | {r.relay.p50:>9.2f} "
                      f"{r.relay.p99:>7.2f} {r.relay.max:>7.1f} | {cdc.p50:>7.2f} "
                      f"{cdc.p99:>7.2f} {cdc.max:>7.1f} | "
                      f"{ratio:>6.1f}x {r.cpu_per_100k:>10.2f} {r.rows_per_batch:>10.1f} "
                      f"{r.wakes_per_msg:>9.2f} {r.relay.missing + cdc.missing:>4}")  # fmt: skip


def section_linger(dsn: str, seconds: float, lingers_ms: list[float], rate: int = 1000) -> None:
    print(f"\n## 6. Linger trade-off: {rate:,} msg/s from 4 writers, plain INSERTs, "
          f"{seconds:.0f} s each")  # fmt: skip
    print(f"{'linger ms':>9} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'CPU-s/100k':>10} "
          f"{'rows/batch':>10} {'wakes/msg':>9}")  # fmt: skip
    for linger in lingers_ms:
        _prepare(dsn)
        r = steady_run(dsn, None, rate, 4, seconds, linger / 1000)
        print(f"{linger:>9.1f} {r.relay.p50:>7.2f} {r.relay.p99:>7.2f} {r.relay.max:>7.1f} "
              f"{r.cpu_per_100k:>10.2f} {r.rows_per_batch:>10.1f} "
              f"{r.wakes_per_msg:>9.2f}")  # fmt: skip


class _SeenSink(StdoutSink):
    """The stdout sink (into /dev/null) that notes when each id reached it, for polling."""

    def __init__(self, stream: Any, seen: dict[int, float]) -> None:
        super().__init__(stream=stream)
        self.seen = seen

    def publish(self, batch: Any) -> None:
        super().publish(batch)
        now = time.monotonic()
        for m in batch:
            self.seen[m.id] = now


def _await(seen: dict[int, float], wanted: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while wanted not in seen and time.monotonic() < deadline:
        time.sleep(0.0005)
    return wanted in seen


def _late_rows(dsn: str, seen: dict[int, float], trials: int) -> tuple[list[float], int]:
    """Late rows the hard way: id n inserted in an open transaction, n+1 committed and
    published (the cursor passes n), then n committed at once (the relay is finishing its
    batch) or after a pause (the relay is idle). Seconds from n's COMMIT to its delivery."""
    delays: list[float] = []
    lost = 0
    with psycopg.connect(dsn, autocommit=True) as writer, psycopg.connect(dsn) as late:
        for trial in range(trials):
            low = int(late.execute(INSERT).fetchone()[0])  # type: ignore[index]
            high = int(writer.execute(INSERT).fetchone()[0])  # type: ignore[index]
            _await(seen, high)
            if trial % 2:
                time.sleep(0.05)  # every other row: commit after the relay went idle
            late.commit()
            committed = time.monotonic()
            if _await(seen, low):
                delays.append(seen[low] - committed)
            else:
                lost += 1
    return delays, lost


def section_late(dsn: str, trials: int, rate: int = 1000) -> None:
    print(f"\n## 8. Late rows (an id committed after a higher one was published), {trials} "
          f"each: traffic stopped vs {rate:,} msg/s of plain INSERTs from 1 writer process "
          "(and that traffic's own end-to-end), same relay, same run")  # fmt: skip
    print("commit of the late row -> its delivery (ms); relay in-process, default options, "
          "the wake-up trigger installed; goal (issue 16): late rows <= 100 ms")  # fmt: skip
    print(f"{'case':<34} {'p50':>7} {'p99':>7} {'max':>7} {'n':>5} {'lost':>4}")
    _prepare(dsn)
    seen: dict[int, float] = {}
    rows: list[tuple[str, list[float], int]] = []
    with Path(os.devnull).open("w") as devnull:
        relay = Relay(dsn, lambda: _SeenSink(devnull, seen), spec=SPEC, options=RelayOptions())
        with running(relay):
            time.sleep(WARM_UP_S)
            with psycopg.connect(dsn, autocommit=True) as warm:  # past the first-claim jump
                _await(seen, int(warm.execute(INSERT).fetchone()[0]))  # type: ignore[index]
            delays, lost = _late_rows(dsn, seen, trials)
            rows.append(("late row, traffic stopped", delays, lost))
            ctx = multiprocessing.get_context("spawn")
            wout, wready, go = ctx.Queue(), ctx.Semaphore(0), ctx.Queue()
            seconds = max(3.0, trials * 0.06)
            child = ctx.Process(target=_writer_child, args=(dsn, rate, seconds, wready, go, wout))
            start_at = _start_together([child], wready, go)
            time.sleep(max(0.0, start_at - time.monotonic()) + 0.3)
            delays, lost = _late_rows(dsn, seen, trials)
            rows.append((f"late row, {rate:,} msg/s flowing", delays, lost))
            committed = dict(wout.get(timeout=seconds + 120))
            child.join(30)
            time.sleep(DRAIN_WAIT_S)
    traffic = Latency.of(committed, seen)
    for name, delays, lost in rows:
        late = Latency.of(dict(enumerate([0.0] * len(delays))), dict(enumerate(delays)))
        print(f"{name:<34} {late.text()} {len(delays):>5} {lost:>4}")
    print(f"{f'the {rate:,} msg/s traffic itself':<34} {traffic.text()} {len(committed):>5} "
          f"{traffic.missing:>4}")  # fmt: skip


EMPTY_FUNCTION = (
    "CREATE OR REPLACE FUNCTION bench_notify_never() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN RETURN NULL; END $$"
)
EMPTY_TRIGGER = (
    "CREATE TRIGGER relay_notify AFTER INSERT ON outbox_new "
    "FOR EACH STATEMENT EXECUTE FUNCTION bench_notify_never()"
)
NAIVE_FUNCTION = (
    "CREATE OR REPLACE FUNCTION bench_notify_always() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN PERFORM pg_notify(TG_ARGV[0], (SELECT min(id)::text FROM new_rows)); "
    "RETURN NULL; END $$"
)
NAIVE_TRIGGER = (
    "CREATE TRIGGER relay_notify AFTER INSERT ON outbox_new REFERENCING NEW TABLE AS new_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION bench_notify_always('outbox_migrate_relay')"
)


def _trigger_mode(dsn: str, mode: str) -> None:
    notify, channel = _wake_up_trigger()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox_new")
        for statement in notify.drop_sql(SPEC):
            conn.execute(statement)
        if mode.startswith("idle-aware"):
            notify.install(conn, SPEC, channel)
        elif mode == "naive":
            conn.execute(NAIVE_FUNCTION)
            conn.execute(NAIVE_TRIGGER)
        elif mode == "empty":
            conn.execute(EMPTY_FUNCTION)
            conn.execute(EMPTY_TRIGGER)
        conn.execute("VACUUM ANALYZE outbox_new")


def _closed_loop(
    dsn: str, writers: int, seconds: float, linger_s: float | None = None
) -> tuple[float, float]:
    """Relay running; `writers` closed-loop writer processes: (inserts/s, commit p99 ms).

    The relay polls every 5 ms (its linger) in every mode: without the trigger a relay polling
    once a second would sleep most of the time and leave the two CPUs to the writers, and the
    comparison would measure the relay's work instead of the trigger's cost. `linger_s`: the
    relay's linger (default: the default); with 0 a relay that finds a trickle keeps the idle
    flag up, so more commits notify.
    """
    ctx = multiprocessing.get_context("spawn")
    default = RelayOptions().linger_s
    options = RelayOptions(
        poll_interval_s=default, linger_s=default if linger_s is None else linger_s
    )
    with Path(os.devnull).open("w") as devnull:
        relay = Relay(dsn, lambda: StdoutSink(stream=devnull), spec=SPEC, options=options)
        with running(relay):
            time.sleep(WARM_UP_S)
            out, ready, go = ctx.Queue(), ctx.Semaphore(0), ctx.Queue()
            children = [
                ctx.Process(target=_closed_writer, args=(dsn, seconds, ready, go, out))
                for _ in range(writers)
            ]
            _start_together(children, ready, go)
            latencies: list[float] = []
            for _ in children:
                latencies.extend(out.get(timeout=seconds + 120))
            for child in children:
                child.join(30)
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)] * 1000 if latencies else float("nan")
    return max(1, len(latencies)) / seconds, p99


MODES = ("none", "empty", "idle-aware", "naive", "none/0", "idle-aware/0")
"""`/0`: with a relay that has no linger (its own baseline: such a relay claims in small
batches back to back under load, which costs the writers CPU on a small server by itself)."""


def section_trigger(
    dsn: str, seconds: float, writer_counts: list[int], fsync: bool, reps: int
) -> None:
    print(f"\n## 7. Wake-up trigger cost to the application: closed-loop INSERT+COMMIT, "
          f"{seconds:.0f} s each, relay running (polling every 5 ms in every mode), "
          f"synchronous_commit on, fsync "
          f"{'on' if fsync else 'off'}, median of {reps} interleaved runs")  # fmt: skip
    print(f"{'writers':>7} | {'none ins/s':>10} {'p99 ms':>7} | {'empty':>8} {'tput':>6} "
          f"{'p99':>6} | {'idle-aware':>10} {'p99 ms':>7} {'tput':>6} {'p99':>6} | "
          f"{'naive':>8} {'p99 ms':>7} {'tput':>6} {'p99':>6} || linger 0: "
          f"{'none':>8} {'p99 ms':>7} | {'trigger':>8} {'tput':>6} {'p99':>6}")  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        if fsync:
            conn.execute("ALTER SYSTEM SET fsync = on")
            conn.execute("SELECT pg_reload_conf()")
    try:
        for writers in writer_counts:
            runs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
            for _ in range(reps):  # interleaved: the machine's load drifts between runs
                for mode in MODES:
                    _trigger_mode(dsn, mode)
                    linger = 0.0 if mode.endswith("/0") else None
                    runs[mode].append(_closed_loop(dsn, writers, seconds, linger))
            base, empty, idle, naive, base0, idle0 = (
                (median([r[0] for r in runs[m]]), median([r[1] for r in runs[m]])) for m in MODES
            )
            print(f"{writers:>7} | {base[0]:>10,.0f} {base[1]:>7.2f} | {empty[0]:>8,.0f} "
                  f"{empty[0] / base[0] - 1:>+6.1%} {empty[1] / base[1]:>5.2f}x | "
                  f"{idle[0]:>10,.0f} {idle[1]:>7.2f} {idle[0] / base[0] - 1:>+6.1%} "
                  f"{idle[1] / base[1]:>5.2f}x | "
                  f"{naive[0]:>8,.0f} {naive[1]:>7.2f} "
                  f"{naive[0] / base[0] - 1:>+6.1%} {naive[1] / base[1]:>5.2f}x || "
                  f"{'':>9} {base0[0]:>8,.0f} {base0[1]:>7.2f} | {idle0[0]:>8,.0f} "
                  f"{idle0[0] / base0[0] - 1:>+6.1%} {idle0[1] / base0[1]:>5.2f}x")  # fmt: skip
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET fsync")
            conn.execute("SELECT pg_reload_conf()")
        _trigger_mode(dsn, "idle-aware")
    print(
        "(tput / p99: the trigger's change in insert throughput and commit p99 vs no trigger, "
        "measured one after the other; empty = a statement trigger that does nothing, the "
        "floor of any trigger-based wake-up; naive = NOTIFY from every inserting statement; "
        "linger 0: the same with a relay that has no linger, against its own baseline)"
    )


# -- builds side by side -------------------------------------------------------------------


HERE = Path(__file__).resolve().parent


def _child_main(dsn: str, linger_ms: float) -> None:
    """`--child`: one relay of whichever build is first on PYTHONPATH, steered by the parent
    through stdin ("begin", "end") and answering on stdout: "ready", then one JSON line."""
    import outbox_migrate

    notify, channel = _wake_up_trigger()
    with psycopg.connect(dsn, autocommit=True) as conn:
        notify.install(conn, SPEC, channel)  # this build's trigger, as it shipped
    seen: list[tuple[int, float]] = []
    tracer = _LineCounter() if os.environ.get(TRACE_ENV) else None
    if tracer is not None:
        threading.settrace(tracer.trace)  # the relay's threads, started below
    with Path(os.devnull).open("w") as devnull:
        # As the CLI runs it, where the build has the option (bench/README.md).
        as_cli: dict[str, Any] = {}
        if "freeze_gc" in inspect.signature(Relay).parameters:  # (an older build may not)
            as_cli["freeze_gc"] = True
        relay = Relay(
            dsn,
            lambda: _RecordingSink(devnull, seen),
            spec=SPEC,
            options=RelayOptions(linger_s=linger_ms / 1000),
            **as_cli,
        )
        with running(relay):
            time.sleep(WARM_UP_S)
            print("ready", outbox_migrate.__file__, flush=True)
            sys.stdin.readline()
            cpu0, wakes0, batches0 = sum(os.times()[:2]), _wakes(), relay.stats.batches
            seen0 = len(seen)
            if tracer is not None:
                tracer.on = True
            sys.stdin.readline()
            if tracer is not None:
                tracer.on = False
            cpu, wakes = sum(os.times()[:2]) - cpu0, _wakes() - wakes0
            window = (relay.stats.batches - batches0, len(seen) - seen0)
            time.sleep(DRAIN_WAIT_S)
            batches = relay.stats.batches
    traced = tracer.report(window) if tracer is not None else None
    print(json.dumps({"cpu": cpu, "wakes": wakes, "batches": batches, "seen": seen,
                      "traced": traced}), flush=True)  # fmt: skip


TRACE_ENV = "OUTBOX_BENCH_TRACE"


class _LineCounter:
    """Python lines and calls the relay's threads execute, per function: what a build does
    per batch, counted rather than timed, so two builds compare alike on a loaded machine
    (its own cost slows the relay several-fold, so it runs apart from the timed rounds)."""

    def __init__(self) -> None:
        self.on = False
        self.lines: dict[str, int] = {}
        self.calls = 0

    def trace(self, frame: Any, event: str, arg: Any) -> Any:
        if self.on:
            code = frame.f_code
            name = f"{Path(code.co_filename).name}:{code.co_name}"
            self.lines[name] = self.lines.get(name, 0) + 1
            self.calls += event == "call"
        return self.trace

    def report(self, window: tuple[int, int]) -> dict[str, Any]:
        """Per batch of the traced window (batches, messages)."""
        per = max(1, window[0])
        top = sorted(self.lines.items(), key=lambda kv: -kv[1])[:80]
        return {
            "rows": window[1] / per,
            "lines": sum(self.lines.values()) / per,
            "calls": self.calls / per,
            "functions": {name: count / per for name, count in top},
        }


def extract(commit: str, into: Path) -> Path:
    """The build's source tree: `.` is this checkout, a commit is `git archive`d under `into`."""
    if commit == ".":
        return HERE.parent
    target = into / commit
    target.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(HERE.parent), "archive", commit], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


class _Signal:
    """`steady_run`'s `begin` event, for a relay that reads its signals from a pipe."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def set(self) -> None:
        self.pipe.write("go\n")
        self.pipe.flush()


def _start_build(dsn: str, source: Path, linger_ms: float, *, trace: bool) -> Any:
    """The relay of the build at `source` in a process of its own, warmed up and waiting."""
    _prepare(dsn, trigger=False)
    env = {**os.environ, "PYTHONPATH": str(source)}
    if trace:
        env[TRACE_ENV] = "1"
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", dsn, str(linger_ms)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    ready = child.stdout.readline().split()
    if not ready or ready[0] != "ready":
        child.kill()
        raise SystemExit(f"the relay of {source} did not start (its error is above)")
    if not Path(ready[1]).resolve().is_relative_to(source):
        child.kill()
        raise SystemExit(f"{source}: the child imported {ready[1]}, another build")
    return child


def _build_measured(
    child: Any, dsn: str, rate: float, writers: int, seconds: float
) -> tuple[dict[int, float], dict[str, Any]]:
    """Paced writers into `dsn` while `child` counts; (committed, the child's report)."""
    try:
        signal = _Signal(child.stdin)
        committed = _paced(dsn, rate, writers, seconds, signal)
        signal.set()
        result = json.loads(child.stdout.readline())
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    return committed, result


def build_run(
    dsn: str,
    source: Path,
    rate: float,
    writers: int,
    seconds: float,
    linger_ms: float,
    *,
    trace: bool = False,
) -> SteadyResult:
    """`steady_run` with the relay of the build at `source`, in a process of its own; `trace`:
    counting its Python lines per batch (`SteadyResult.traced`) instead of timing it."""
    child = _start_build(dsn, source, linger_ms, trace=trace)
    return _result(*_build_measured(child, dsn, rate, writers, seconds), rate, writers)


def builds_together(
    dsns: list[str], sources: list[Path], rate: float, writers: int, seconds: float,
    linger_ms: float,
) -> list[SteadyResult]:  # fmt: skip
    """Every build's relay at once, each on its own database under writers of its own at
    `rate`: a drift of the machine (another tenant, the CPU's clock) falls on all of them
    alike, where runs one after the other each meet their own."""
    children = [
        _start_build(d, s, linger_ms, trace=False) for d, s in zip(dsns, sources, strict=True)
    ]
    with ThreadPoolExecutor(len(children)) as pool:
        runs = [pool.submit(_build_measured, c, d, rate, writers, seconds)
                for c, d in zip(children, dsns, strict=True)]  # fmt: skip
        return [_result(*run.result(), rate, writers) for run in runs]


def _result(
    committed: dict[int, float], result: dict[str, Any], rate: float, writers: int
) -> SteadyResult:
    seen = {int(i): t for i, t in result["seen"]}
    n = len(committed)
    return SteadyResult(
        rate=rate,
        writers=writers,
        relay=Latency.of(committed, seen),
        cdc=None,
        cpu_per_100k=result["cpu"] * 100_000 / max(1, n),
        rows_per_batch=len(seen) / max(1, result["batches"]),
        messages=n,
        wakes_per_msg=result["wakes"] / max(1, n),
        traced=result.get("traced"),
    )


def section_trace(
    dsn: str, builds: list[str], sources: dict[str, Path], seconds: float, rate: int,
    writers: int, linger_ms: float, rows: dict[str, float],
) -> None:  # fmt: skip
    """Python lines per batch, counted: each build traced at a quarter of `rate` and at
    `rate`. The tracer slows a relay, and a slower relay claims bigger batches, so the two
    runs fit lines = per batch + per message * rows, read at the rows per batch of the timed
    rounds (`rows`): builds compare at equal batches, whatever the tracer did to them."""
    print(f"\n## Python work per batch, counted: each build traced at {rate // 4:,} and "
          f"{rate:,} msg/s ({seconds:.0f} s each), lines fitted as a + b * rows and read at "
          f"the timed rounds' rows per batch")  # fmt: skip
    print(f"{'build':<10} {'per batch a':>11} {'per msg b':>9} {'rows/batch':>10} "
          f"{'lines/batch':>11} {'vs first':>8}")  # fmt: skip
    fitted: dict[str, dict[str, float]] = {}
    for build in builds:
        runs = [
            build_run(dsn, sources[build], r, writers, seconds, linger_ms, trace=True).traced
            or {"rows": 0.0, "lines": 0.0, "functions": {}}
            for r in (rate // 4, rate)
        ]
        at = rows[build]

        def fit(low: float, high: float, runs: list[dict[str, Any]] = runs) -> tuple[float, float]:
            spread = runs[1]["rows"] - runs[0]["rows"]
            per_msg = (high - low) / spread if spread > 0.5 else 0.0
            return low - per_msg * runs[0]["rows"], per_msg

        a, b = fit(runs[0]["lines"], runs[1]["lines"])
        names = set(runs[0]["functions"]) | set(runs[1]["functions"])
        fitted[build] = {}
        for name in names:
            fa, fb = fit(runs[0]["functions"].get(name, 0.0), runs[1]["functions"].get(name, 0.0))
            fitted[build][name] = fa + fb * at
        total = fitted[build][""] = a + b * at
        first = fitted[builds[0]][""] or 1.0
        print(f"{build:<10} {a:>11.0f} {b:>9.1f} {at:>10.1f} {total:>11.0f} "
              f"{total / first:>7.0%}")  # fmt: skip
    base = fitted[builds[0]]
    for build in builds[1:]:
        now = fitted[build]
        changed = sorted((set(base) | set(now)) - {""},
                       key=lambda f: -abs(now.get(f, 0.0) - base.get(f, 0.0)))  # fmt: skip
        print(f"lines/batch, {builds[0]} → {build}, largest differences (file:function; a "
              f"function moved between files shows twice):")  # fmt: skip
        for name in changed[:14]:
            print(f"  {base.get(name, 0.0):>6.1f} → {now.get(name, 0.0):>6.1f}  {name}")


def section_compare(
    dsns: list[str], builds: list[str], rounds: int, seconds: float, rate: int, writers: int,
    *, trace: bool = False, together: bool = False,
) -> None:  # fmt: skip
    """`dsns`: one database per build (`together`), else the first for all."""
    dsn = dsns[0]
    linger_ms = RelayOptions().linger_s * 1000
    how = (f"{rounds} rounds, the builds at the same time, each on its own database under "
           f"{writers} writers of its own (databases swapped round by round)" if together
           else f"{rounds} interleaved rounds")  # fmt: skip
    print(f"\n## Builds side by side: {rate:,} msg/s of plain INSERTs from {writers} interleaved "
          f"writer processes, the wake-up trigger, stdout sink into /dev/null, linger "
          f"{linger_ms:g} ms, {seconds:.0f} s per run, {how}")  # fmt: skip
    print(f"{'round':>5} {'build':<10} {'CPU-s/100k':>10} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'max ms':>7} {'rows/batch':>10} {'wakes/msg':>9} {'lost':>4}  load")  # fmt: skip
    results: dict[str, list[SteadyResult]] = {b: [] for b in builds}
    with tempfile.TemporaryDirectory(prefix="relay-steady-") as tmp:
        sources = {b: extract(b, Path(tmp)) for b in builds}
        for round_ in range(1, rounds + 1):
            if together:
                shift = round_ % len(builds)
                order = dsns[shift:] + dsns[:shift]
                both = builds_together(order[: len(builds)], [sources[b] for b in builds],
                                       rate, writers, seconds, linger_ms)  # fmt: skip
            for k, build in enumerate(builds):
                if together:
                    r = both[k]
                else:
                    r = build_run(dsn, sources[build], rate, writers, seconds, linger_ms)
                results[build].append(r)
                print(f"{round_:>5} {build:<10} {r.cpu_per_100k:>10.2f} {r.relay.p50:>7.2f} "
                      f"{r.relay.p99:>7.2f} {r.relay.max:>7.1f} {r.rows_per_batch:>10.1f} "
                      f"{r.wakes_per_msg:>9.2f} {r.relay.missing:>4}  "
                      f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        if trace:
            rows = {b: median([r.rows_per_batch for r in rs]) for b, rs in results.items()}
            section_trace(dsn, builds, sources, min(seconds, 10.0), rate, writers, linger_ms,
                          rows)  # fmt: skip
    print(f"{'median':>5} {'build':<10} {'CPU-s/100k':>10} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'vs first':>8} {'pairs: median':>13} {'mean':>5}  each round")  # fmt: skip
    firsts = [r.cpu_per_100k for r in results[builds[0]]]
    first = median(firsts)
    for build in builds:
        rs = results[build]
        cpu = median([r.cpu_per_100k for r in rs])
        # Each round's ratio to the first build's: what a drift between rounds cannot move.
        pairs = [r.cpu_per_100k / f for r, f in zip(rs, firsts, strict=True) if f]
        each = " ".join(f"{p - 1:+.0%}" for p in pairs)
        print(f"{'':>5} {build:<10} {cpu:>10.2f} {median([r.relay.p50 for r in rs]):>7.2f} "
              f"{median([r.relay.p99 for r in rs]):>7.2f} {cpu / first:>7.0%} "
              f"{median(pairs):>13.0%} {statistics.fmean(pairs):>5.0%}  {each}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Relay builds' steady state side by side")
    parser.add_argument("--compare", nargs="+", metavar="COMMIT", default=[],
                        help="builds to compare: commits, or . for this checkout")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=35.0)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--together", action="store_true",
                        help="run the builds at the same time, each on a database and writers "
                             "of its own, instead of one after the other")  # fmt: skip
    parser.add_argument("--trace", action="store_true",
                        help="also count each build's Python lines, calls per batch")  # fmt: skip
    parser.add_argument("--child", nargs=2, metavar=("DSN", "LINGER_MS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child_main(args.child[0], float(args.child[1]))
        return
    if not args.compare:
        parser.error("--compare COMMIT ... is required (the other sections: bench/relay.py)")
    from outbox_migrate_harness.testing import server as pgserver
    from outbox_migrate_harness.testing.schema import create_partitioned_outbox

    srv = pgserver.start(18)
    try:
        dsn = srv.dsn()
        print(f"PostgreSQL {srv.full_version}, fsync off (throwaway); {load_note()} at start")
        dsns = [dsn]
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_partitioned_outbox(conn, SPEC, start=1_000_000_000)
            for k in range(1, len(args.compare) if args.together else 1):
                conn.execute(f"CREATE DATABASE steady_{k} TEMPLATE template0")
                dsns.append(srv.dsn(f"steady_{k}"))
                with psycopg.connect(dsns[-1], autocommit=True) as other:
                    create_partitioned_outbox(other, SPEC, start=1_000_000_000)
        section_compare(dsns, args.compare, args.rounds, args.seconds, args.rate, args.writers,
                        trace=args.trace, together=args.together)  # fmt: skip
        print(f"({load_note()})")
    finally:
        srv.stop()


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


if __name__ == "__main__":
    main()
