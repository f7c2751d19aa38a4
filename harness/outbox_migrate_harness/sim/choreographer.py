"""The choreographer: rolls application versions like a rolling deploy and runs the runner's
steps at each boundary, while writers and relays keep the outbox busy (docs/demo.md)."""

from __future__ import annotations

import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg

from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.errors import PreconditionFailed
from outbox_migrate.jobs.common import backlog
from outbox_migrate.lock_budget import AttemptLog
from outbox_migrate.patterns import build_from_settings
from outbox_migrate.patterns.model import Phase, PhaseKind, Step, Table
from outbox_migrate.runner import Runner
from outbox_migrate.runner.events import SilentEvents
from outbox_migrate_harness.sim import recording
from outbox_migrate_harness.sim.actors import RelayResult, WriterResult, relay_main, writer_main
from outbox_migrate_harness.sim.scenario import APP_NAME_PREFIX, Scenario, relay_mode
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

GATE_RETRY_S = 0.5
GATE_PATIENCE_S = 60.0
"""How long the choreographer waits for a deploy gate before giving up (a stuck rollout)."""
WRONG_CHOREOGRAPHY_PATIENCE_S = 6.0
DRAIN_TIMEOUT_S = 60.0
MONITOR_INTERVAL_S = 0.5
READY_TIMEOUT_S = 60.0
COLLECT_POLL_S = 0.02
"""How often a stop checks whether its instances have exited (while reading their results)."""
RESULTS_TIMEOUT_S = 5.0
"""How long the end of a run waits for stopped instances' results (normally milliseconds)."""


@dataclass
class Marker:
    """A moment on the timeline: a deploy, a step, a refusal."""

    at: float
    kind: str
    label: str
    detail: str = ""


@dataclass
class StepRecord:
    step: str
    phase: str
    started: float
    finished: float = 0.0
    outcome: str = ""
    attempts: int = 0
    lock_timeouts: int = 0
    lock_wait_ms: float = 0.0


@dataclass
class Snapshot:
    elapsed_s: float
    phase: str
    step: str
    received: int
    backlog: int
    max_lag_s: float
    insert_rate_per_s: float
    publish_rate_per_s: float


@dataclass
class RunData:
    scenario: Scenario
    started: float
    finished: float = 0.0
    markers: list[Marker] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    writers: list[WriterResult] = field(default_factory=list)
    relays: list[RelayResult] = field(default_factory=list)
    received: dict[str, Any] = field(default_factory=dict)
    phase_windows: list[tuple[str, float, float]] = field(default_factory=list)
    refusal: dict[str, Any] | None = None
    backlog_left: int = 0
    interrupted: bool = False
    """Stopped by Ctrl-C/SIGTERM: the report is partial and unpublished rows are backlog."""


class Choreographer(SilentEvents):
    """Also the runner's events listener: each step's timing and lock attempts are recorded."""

    def __init__(
        self,
        dsn: str,
        recording_dsn: str,
        scenario: Scenario,
        *,
        on_snapshot: Callable[[Snapshot], None] | None = None,
        prepare: Callable[[str], None] | None = None,
    ) -> None:
        """`prepare(dsn)` builds and fills the outbox before the run; by default the spec's
        table with 2,000 published rows (`rehearse` passes a copy of the user's table)."""
        self.dsn = dsn
        self._prepare = prepare or _demo_outbox
        self.recording_dsn = recording_dsn
        self.scenario = scenario
        self.on_snapshot = on_snapshot
        flags = {"gate_window_s": scenario.gate_window_s, "old_app_name": f"{APP_NAME_PREFIX}/V1/%",
                 "lock_timeout_ms": scenario.lock_timeout_ms}  # fmt: skip
        self.settings = replace(load_settings(flags, environ={}), spec=scenario.spec)
        self.data = RunData(scenario, time.time())
        self.current_phase = "V1"
        self.current_step = ""
        # forkserver: every instance forks from one server process that already imported
        # psycopg and the relay, so a deploy starts in milliseconds instead of re-importing
        # everything per process (and nothing leaks from this, possibly threaded, process).
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(
            ["outbox_migrate_harness.sim.instance_signals", "psycopg",
             "outbox_migrate_harness.sim.actors", "outbox_migrate.relay.worker"]
        )  # fmt: skip
        self._results: Any = self._ctx.Queue()
        self._instances: dict[str, list[tuple[str, Any, Any]]] = {}
        self._done = threading.Event()
        self._stray_since = 0
        self._window: tuple[str, float] | None = None
        self._stopped = 0
        self._collected = 0
        """Instances told to stop, and results received: each stopped instance sends one."""

    def step_started(self, step: Step, action: str) -> None:
        if action == "already-done":
            return
        self.current_step = step.id
        self.data.steps.append(StepRecord(step.id, step.phase, time.time()))
        self.mark("step", step.id)

    def attempt(self, step: Step, log: AttemptLog) -> None:
        record = self.data.steps[-1]
        record.attempts += 1
        if log.outcome == "lock_timeout":
            record.lock_timeouts += 1
            record.lock_wait_ms += log.waited_ms

    def step_finished(self, step: Step, outcome: str, elapsed_s: float) -> None:
        record = self.data.steps[-1]
        record.finished = time.time()
        record.outcome = outcome
        self.current_step = ""

    def mark(self, kind: str, label: str, detail: str = "") -> None:
        self.data.markers.append(Marker(time.time(), kind, label, detail))

    def _start_version(self, phase: Phase) -> None:
        s = self.scenario
        table = s.spec.table if phase.app.inserts_into is Table.OLD else s.spec.partitioned_table
        procs: list[tuple[str, Any, Any]] = []
        ready: list[Any] = []

        def add(role: str, target: Callable[..., None], *args: Any) -> None:
            stop, up = self._ctx.Event(), self._ctx.Event()
            args = (*args, s, stop, self._results, up)
            procs.append((role, self._ctx.Process(target=target, args=args, daemon=True), stop))
            ready.append(up)

        for index in range(s.writers):
            add("writer", writer_main, self.dsn, table, phase.name, index)
        mode = relay_mode(phase)
        for index in range(s.relays if mode is not None else 0):
            add("relay", relay_main, self.dsn, self.recording_dsn, phase.name, index, mode)
        # Registered as each one starts, so an interrupt during the rollout still stops
        # (and counts) every instance that exists.
        started = self._instances.setdefault(phase.name, [])
        for instance in procs:
            with _signals_deferred():  # never half-way through the forkserver's protocol
                instance[1].start()
                started.append(instance)
        # A rollout counts an instance as deployed once it is up: wait for every one, so
        # old and new really overlap before the old ones are stopped.
        for event in ready:
            event.wait(READY_TIMEOUT_S)
        self.mark("deploy", phase.name, phase.app.describe(s.spec.table, s.spec.partitioned_table))

    def _stop(self, version: str, role: str, *, keep: int | None = None) -> None:
        chosen = [
            (proc, stop)
            for index, (kind, proc, stop) in enumerate(self._instances.get(version, []))
            if kind == role and index != keep
        ]
        self._stop_and_wait(chosen)
        self.mark("stop", f"{version} {role}s")

    def _stop_and_wait(self, chosen: list[tuple[Any, Any]]) -> None:
        for _, stop in chosen:
            if not stop.is_set():
                stop.set()
                self._stopped += 1
        # A child cannot exit while its result is still in the queue's pipe: collect results
        # while waiting, or join() would wait for ever on a full pipe.
        deadline = time.monotonic() + 60
        while any(proc.is_alive() for proc, _ in chosen) and time.monotonic() < deadline:
            self._collect()
        for proc, _ in chosen:
            proc.join(5)

    def _retire(self, version: str) -> None:
        """An old instance goes away whole: its writer stops, then its relay finishes the
        in-flight batch and disconnects (what it wrote is published by the new version).

        With the wrong choreography, V1's first writer is forgotten by the rollout."""
        forgotten = 0 if self.scenario.wrong_choreography and version == "V1" else None
        self._stop(version, "writer", keep=forgotten)
        self._stop(version, "relay")
        if forgotten is not None:
            self.mark("deploy", "V1 writer left running", "the rollout forgot one V1 instance")
            with psycopg.connect(self.dsn) as conn:
                row = conn.execute("SELECT coalesce(max(id), 0) FROM outbox").fetchone()
            self._stray_since = int(row[0]) if row else 0

    def _run_phase(self, phase: Phase, patience_s: float = GATE_PATIENCE_S) -> bool:
        """Apply the phase's steps, retrying while a deploy gate says "not yet"."""
        deadline = time.monotonic() + patience_s
        last = ""
        while True:
            try:
                with Runner(self.dsn, self.settings, self.scenario.pattern,
                            events=self) as runner:  # fmt: skip
                    runner.run(phase.name)
                return True
            except PreconditionFailed as exc:
                if str(exc) != last:
                    self.mark("gate", exc.step_id, exc.observed)
                    last = str(exc)
                if time.monotonic() > deadline:
                    self.data.refusal = {"step": exc.step_id, "condition": exc.condition,
                                         "observed": exc.observed}  # fmt: skip
                    return False
                time.sleep(GATE_RETRY_S)

    def _monitor(self) -> None:
        if self.on_snapshot is None:
            return
        previous_received = 0
        previous_inserted = 0
        previous_at = time.monotonic()
        with psycopg.connect(self.dsn, autocommit=True, application_name="demo-monitor") as db, \
                psycopg.connect(self.recording_dsn, autocommit=True) as rec:  # fmt: skip
            while not self._done.wait(MONITOR_INTERVAL_S):
                backlog = _backlog(db, self.scenario.spec)
                row = rec.execute(
                    f"SELECT count(*), coalesce(extract(epoch FROM max(received_at - created_at) "
                    f"FILTER (WHERE received_at > now() - interval '2 s')), 0) "
                    f"FROM {recording.TABLE}"
                ).fetchone()
                received = int(row[0]) if row else 0
                lag = float(row[1]) if row else 0.0
                now = time.monotonic()
                inserted = received + backlog
                span = max(now - previous_at, 1e-6)
                self.on_snapshot(Snapshot(
                    time.time() - self.data.started, self.current_phase, self.current_step,
                    received, backlog, lag, max(inserted - previous_inserted, 0) / span,
                    max(received - previous_received, 0) / span,
                ))  # fmt: skip
                previous_received, previous_inserted, previous_at = received, inserted, now

    def run(self) -> RunData:
        self._prepare(self.dsn)
        recording.create(self.recording_dsn)
        monitor = threading.Thread(target=self._monitor, daemon=True)
        monitor.start()
        try:
            self._walk(build_from_settings(self.scenario.pattern, self.settings).phases)
        except KeyboardInterrupt:
            # Stop at once, but cleanly: every instance stopped and its results collected,
            # so the partial report is written; the caller re-raises the interrupt.
            self.data.interrupted = True
            self.mark("interrupted", self.current_step or self.current_phase)
            self._next_window(None)
        finally:
            self._shutdown(drain=not self.data.interrupted)
            self._done.set()
            monitor.join(5)
        self.data.finished = time.time()
        self.data.received = recording.received(self.recording_dsn)
        return self.data

    def _walk(self, phases: tuple[Phase, ...]) -> None:
        s = self.scenario
        deployed = phases[0].name
        self._next_window(deployed)
        self._start_version(phases[0])
        time.sleep(s.segment_s)
        for phase in phases[1:]:
            if phase.kind is PhaseKind.JOB:
                self.current_phase = phase.name
                self.mark("job", phase.name)
                self._run_phase(phase)
                continue
            if s.wrong_choreography and phase.name == "V3":
                self._wrong_v3(phase)
            if not self._run_phase(phase):
                return
            self._next_window(phase.name)
            self.current_phase = phase.name
            self._start_version(phase)
            time.sleep(s.coexist_s)
            self._retire(deployed)
            deployed = phase.name
            time.sleep(s.segment_s)
        self._next_window(None)

    def _next_window(self, version: str | None) -> None:
        """Close the phase window in progress (labelled with the version whose deploy opened
        it), and open one for `version`."""
        now = time.time()
        if self._window is not None:
            self.data.phase_windows.append((*self._window, now))
        self._window = None if version is None else (version, now)

    def _wrong_v3(self, phase: Phase) -> None:
        """Try V3 while the forgotten V1 writer still inserts into the old table (the runner
        must refuse), name the rows V3 would have stranded, then stop the writer and retry."""
        tried_at = time.time()
        ok = self._run_phase(phase, patience_s=WRONG_CHOREOGRAPHY_PATIENCE_S)
        refusal = self.data.refusal or {}
        self.data.refusal = None
        self.mark("refused" if not ok else "gate", phase.name, refusal.get("observed", ""))
        self._stop("V1", "writer")
        with psycopg.connect(self.dsn) as conn:
            rows = conn.execute(
                "SELECT id, message_key FROM outbox WHERE message_key LIKE 'V1-w0-%%' "
                "AND id > %s ORDER BY id",
                (self._stray_since,),
            ).fetchall()
        self.data.refusal = {
            **refusal,
            "refused": not ok,
            "at": tried_at,
            "would_strand": {
                "count": len(rows),
                "first_ids": [int(r[0]) for r in rows[:20]],
                "first_keys": [str(r[1]) for r in rows[:20]],
            },
        }

    def _collect(self) -> None:
        try:
            with _signals_deferred():  # an interrupt mid-message would corrupt the pipe
                kind, result = self._results.get(timeout=COLLECT_POLL_S)
        except queue.Empty:
            return
        self._collected += 1
        (self.data.writers if kind == "writer" else self.data.relays).append(result)

    def _shutdown(self, *, drain: bool = True) -> None:
        """Stop writers, let the relays drain what is left, then stop them (interrupted: every
        instance at once, what is left counted as backlog). Then wait for exactly the stopped
        instances' results, not a fixed time: every message written counted, an interrupt prompt."""
        if drain:
            for version in list(self._instances):
                self._stop(version, "writer")
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while (backlog := self._backlog()) and time.monotonic() < deadline:
                time.sleep(0.2)
            self.data.backlog_left = backlog
            for version in list(self._instances):
                self._stop(version, "relay")
        else:
            everyone = [(proc, stop) for procs in self._instances.values()
                        for _, proc, stop in procs]  # fmt: skip
            self._stop_and_wait(everyone)
            self.mark("stop", "every instance")
            self.data.backlog_left = self._backlog()
        deadline = time.monotonic() + RESULTS_TIMEOUT_S
        while self._collected < self._stopped and time.monotonic() < deadline:
            self._collect()

    def _backlog(self) -> int:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return _backlog(conn, self.scenario.spec)


def _demo_outbox(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 2_000, published=True)


def _backlog(conn: psycopg.Connection[Any], spec: OutboxSpec) -> int:
    found = (backlog(conn, spec, t) for t in (spec.table, spec.partitioned_table))
    return sum(f[0] for f in found if f is not None)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT/SIGTERM held back (delivered, and raised, on leaving) while the main thread is
    inside multiprocessing plumbing that an exception half-way through would leave broken: a
    queue message half read, a process half started."""
    held = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
