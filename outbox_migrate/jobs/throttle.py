"""How fast a background job may go: a target rate plus back-off on measured foreground impact.
The decision functions are pure; the drivers below them only measure.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg import sql

PROBE_INTERVAL_S = 0.02
"""Time between two latency probes in the probe thread."""
PROBE_WINDOW_S = 1.0
"""Probes older than this no longer count towards the current latency."""
BASELINE_PROBES = 25
"""Probes timed before the job starts to learn the unloaded latency."""
MIN_PAUSE_S = 0.01
"""First back-off step once foreground impact is over budget."""
PROBE_MIN_SAMPLES = 3
"""Probes taken while copying, within the window, needed before their latency counts."""
AMBIENT_WINDOW_S = 10.0
"""Probes taken while the job paused, within this window, define the ambient latency."""
AMBIENT_MIN_PROBES = 5
"""Fewer idle probes than this: keep the baseline measured before the job started."""
PROBE_STOP_WAIT_S = 2.0
"""How long stopping waits for a running probe before cancelling it."""
PROBE_STATEMENT_TIMEOUT_MS = 30_000
"""A probe stuck longer than this gives up (the job has long since backed off)."""


@dataclass(frozen=True)
class ThrottlePolicy:
    """Limits for a background job. The defaults favour the foreground."""

    rate_rows_per_s: float | None = None
    """Ceiling on the job's own rate; None = as fast as impact allows."""
    adaptive: bool = True
    """Back off on measured foreground impact (replica lag or probe latency)."""
    max_replica_lag_s: float = 5.0
    """Replay lag of the slowest replica above which the job pauses."""
    max_replica_lag_bytes: int = 256 * 1024 * 1024
    """WAL not yet replayed by the slowest replica above which the job pauses."""
    probe_factor: float = 1.5
    """Probe latency budget: the unloaded baseline times this factor ..."""
    probe_floor_ms: float = 1.0
    """... but never less than baseline plus this floor (sub-millisecond noise)."""
    max_pause_s: float = 2.0
    """Longest pause between two batches."""


@dataclass(frozen=True)
class Impact:
    source: Literal["replica_lag", "latency_probe", "none"]
    value: float
    """Seconds of replica lag, or milliseconds of probe latency."""
    limit: float
    over: bool


def rate_pause_s(done: int, elapsed_s: float, rate_rows_per_s: float | None) -> float:
    """Seconds to wait so that `done` rows over the elapsed time stay within the rate."""
    if rate_rows_per_s is None or rate_rows_per_s <= 0:
        return 0.0
    due_s = done / rate_rows_per_s
    return max(0.0, due_s - elapsed_s)


def pause(seconds: float, stop: threading.Event | None) -> None:
    if stop is not None:
        stop.wait(seconds)
    else:
        time.sleep(seconds)


def next_backoff_s(current_s: float, over_budget: bool, policy: ThrottlePolicy) -> float:
    """Multiplicative increase while over budget, multiplicative decrease otherwise.

    Halving rather than resetting avoids oscillating between full speed and a long pause.
    """
    if over_budget:
        return min(policy.max_pause_s, max(MIN_PAUSE_S, current_s * 2))
    halved = current_s / 2
    return 0.0 if halved < MIN_PAUSE_S else halved


def probe_limit_ms(baseline_ms: float, policy: ThrottlePolicy) -> float:
    return max(baseline_ms * policy.probe_factor, baseline_ms + policy.probe_floor_ms)


def replica_impact(conn: psycopg.Connection[Any], policy: ThrottlePolicy) -> Impact | None:
    """The slowest streaming replica's lag, or None when there is no replica to watch."""
    row = conn.execute(
        "SELECT count(*),"
        " coalesce(max(extract(epoch FROM replay_lag)), 0)::float8,"
        " coalesce(max(pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)), 0)::float8"
        " FROM pg_stat_replication WHERE state = 'streaming'"
    ).fetchone()
    if row is None or int(row[0]) == 0:
        return None
    lag_s, lag_bytes = float(row[1]), float(row[2])
    over = lag_s > policy.max_replica_lag_s or lag_bytes > policy.max_replica_lag_bytes
    return Impact("replica_lag", lag_s, policy.max_replica_lag_s, over)


class LatencyProbe:
    """Times a tiny query on its own connection, continuously, in a daemon thread.

    The query is an index probe on the given relation (the relay's hot path), so what slows
    the foreground (CPU, I/O, buffer contention caused by the job) slows the probe too.
    """

    def __init__(self, dsn: str, relation: sql.Composable, column: sql.Composable) -> None:
        self._query = sql.SQL("SELECT {c} FROM {r} ORDER BY {c} LIMIT 1").format(
            c=column, r=relation
        )
        self._dsn = dsn
        # (monotonic time, latency ms, was the job copying when the probe started)
        self._samples: deque[tuple[float, float, bool]] = deque(maxlen=2000)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._inflight_since: float | None = None
        self.baseline_ms = 0.0
        """Latency before the job started."""
        self.active = False
        """Set by the job: True while a batch runs, False while it pauses."""

    def _time_once(self, conn: psycopg.Connection[Any]) -> float:
        started = time.perf_counter()
        with self._lock:
            self._inflight_since = started
        try:
            conn.execute(self._query).fetchall()
        finally:
            with self._lock:
                self._inflight_since = None
        return (time.perf_counter() - started) * 1000.0

    def start(self) -> None:
        from outbox_migrate.db import connect

        self._conn = connect(self._dsn, application_name="outbox-migrate/probe")
        self._conn.execute(
            sql.SQL("SET statement_timeout = {}").format(
                sql.Literal(f"{PROBE_STATEMENT_TIMEOUT_MS}ms")
            )
        )
        self._conn.execute(self._query)  # plan cache warm-up, not a sample
        samples = []
        for _ in range(BASELINE_PROBES):
            samples.append(self._time_once(self._conn))
            time.sleep(PROBE_INTERVAL_S / 4)
        self.baseline_ms = statistics.median(samples)
        self._thread = threading.Thread(target=self._loop, name="latency-probe", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        conn = self._conn
        assert conn is not None
        while not self._stop.is_set():
            active = self.active
            try:
                latency = self._time_once(conn)
            except psycopg.Error:
                return  # the job carries on unprobed rather than failing on its monitor
            with self._lock:
                self._samples.append((time.monotonic(), latency, active))
            self._stop.wait(PROBE_INTERVAL_S)

    def recent_ms(self) -> float | None:
        """The 90th percentile of the probes taken while the job copied, over the last
        window; None before any.

        A probe still running counts with its age so far: a foreground query that is stuck
        (behind a lock, on a saturated server) must slow the job down, not go unseen because
        no sample completes.
        """
        cutoff = time.monotonic() - PROBE_WINDOW_S
        with self._lock:
            values = [v for t, v, active in self._samples if t >= cutoff and active]
            inflight = self._inflight_since
        stuck_ms = (time.perf_counter() - inflight) * 1000.0 if inflight is not None else 0.0
        if len(values) < PROBE_MIN_SAMPLES:
            # Too few to judge (one slow sample is noise), unless one is stuck right now.
            return stuck_ms or None
        values.sort()
        return max(stuck_ms, values[min(len(values) - 1, int(len(values) * 0.9))])

    def ambient_ms(self) -> float:
        """The latency the server has without us: the median of the probes taken while the
        job paused, over the last `AMBIENT_WINDOW_S`; the start baseline until there are some.

        Re-learning it while paused keeps the budget relative to the load the job does not
        cause: if the application itself gets busier, the job does not stall for good.
        """
        cutoff = time.monotonic() - AMBIENT_WINDOW_S
        with self._lock:
            idle = [v for t, v, active in self._samples if t >= cutoff and not active]
        if len(idle) < AMBIENT_MIN_PROBES:
            return self.baseline_ms
        return statistics.median(idle)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PROBE_STOP_WAIT_S)
            if self._thread.is_alive() and self._conn is not None:
                # The probe is stuck in a query (behind a lock): cancel it rather than wait,
                # since closing a connection another thread is using would block on it.
                self._conn.cancel_safe(timeout=PROBE_STOP_WAIT_S)
                self._thread.join(timeout=PROBE_STOP_WAIT_S)
        if self._conn is not None:
            self._conn.close()


class Throttle:
    """Combines the rate ceiling and impact back-off into one pause per batch."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        policy: ThrottlePolicy,
        probe: LatencyProbe | None,
    ) -> None:
        self.policy = policy
        self._conn = conn
        self._probe = probe
        if probe is not None:
            probe.active = True  # created right before the first batch
        self._backoff_s = 0.0
        self._started = time.monotonic()
        self._done_at_start = 0
        self.last_impact: Impact | None = None
        self.paused_s = 0.0

    def measure(self) -> Impact:
        if not self.policy.adaptive:
            return Impact("none", 0.0, 0.0, False)
        # Replica lag first where there are replicas: that is what a bulk copy hurts first.
        replica = replica_impact(self._conn, self.policy)
        if replica is not None:
            return replica
        if self._probe is not None:
            recent = self._probe.recent_ms()
            if recent is not None:
                limit = probe_limit_ms(self._probe.ambient_ms(), self.policy)
                return Impact("latency_probe", recent, limit, recent > limit)
        return Impact("none", 0.0, 0.0, False)

    def pause_s(self, done: int) -> float:
        """The pause owed after a batch, given `done` rows since the clock started."""
        impact = self.measure()
        self.last_impact = impact
        self._backoff_s = next_backoff_s(self._backoff_s, impact.over, self.policy)
        elapsed = time.monotonic() - self._started
        owed = rate_pause_s(done - self._done_at_start, elapsed, self.policy.rate_rows_per_s)
        return max(owed, self._backoff_s)

    def wait(self, done: int, stop: threading.Event | None) -> float:
        owed = self.pause_s(done)
        if owed > 0:
            self.paused_s += owed
            if self._probe is not None:
                self._probe.active = False
            pause(owed, stop)
        if self._probe is not None:
            self._probe.active = True  # the next batch starts right away
        return owed
