"""Prometheus metrics and the health endpoints, both optional (docs/relay.md, "Metrics, health
and log events"). The base `Observer` does nothing, so the relay runs without
prometheus-client; each `PrometheusObserver` has its own registry, so relays do not clash.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from outbox_migrate.errors import ConnectError, RelayError

HEALTH_STALE_S = 60.0
"""A worker backing off from a dead broker still finishes loop iterations: it stays healthy."""
READY_STALE_S = 40.0
"""A lease check older than this makes the process unready: longer than the sink backoff cap
(30 s), during which a worker does not come back to its lease."""
METRICS_INTERVAL_S = 5.0
"""How often the backlog (polling) or the slot's lag (CDC) is sampled."""
BATCH_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Observer:
    def published(self, count: int) -> None: ...

    def failed(self, reason: str, count: int = 1) -> None: ...

    def batch_seconds(self, seconds: float) -> None: ...

    def backlog(self, rows: int, oldest_age_s: float) -> None: ...

    def heartbeat(self, worker: int) -> None: ...

    def worker_done(self, worker: int) -> None: ...

    def lease_checked(self, worker: int, owned: int) -> None:
        """A worker's session proved alive and holds `owned` shards (0 = a live standby)."""

    def slot(self, lag_bytes: int, lag_s: float, active: bool) -> None:
        """CDC mode: the replication slot's lag and whether a relay streams from it."""

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return True


def start_sampler(
    observer: Observer,
    stop: threading.Event,
    connect: Callable[[], AbstractContextManager[Any]],
    look: Callable[[Any], None],
    name: str,
) -> threading.Thread | None:
    """A daemon thread calling `look(conn)` every METRICS_INTERVAL_S on a session of its own
    until `stop`; None for the base `Observer`."""
    if type(observer) is Observer:
        return None

    def sample() -> None:
        import psycopg

        while not stop.is_set():
            try:
                with connect() as conn:
                    while not stop.is_set():
                        look(conn)
                        stop.wait(METRICS_INTERVAL_S)
            except (psycopg.OperationalError, psycopg.InterfaceError, ConnectError):
                stop.wait(METRICS_INTERVAL_S)

    thread = threading.Thread(target=sample, name=name, daemon=True)
    thread.start()
    return thread


class PrometheusObserver(Observer):
    def __init__(self) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise RelayError(
                "metrics need prometheus-client: install outbox-migrate[metrics]"
            ) from None
        self._prom = prom
        self.registry = prom.CollectorRegistry()
        gauge = self._gauge
        self._published = prom.Counter(
            "outbox_relay_published", "Messages acknowledged and marked", registry=self.registry
        )
        self._failed = prom.Counter(
            "outbox_relay_failed",
            "Failed attempts by reason (sink, rejected, serialization, connection)",
            ["reason"],
            registry=self.registry,
        )
        self._latency = prom.Histogram(
            "outbox_relay_batch_seconds",
            "Claim + publish + mark time of one batch",
            buckets=BATCH_BUCKETS_S,
            registry=self.registry,
        )
        self._backlog = gauge("backlog_rows", "Unpublished rows")
        self._oldest = gauge("oldest_unpublished_age_seconds", "Age of the oldest unpublished row")
        self._shards = gauge("shards_owned", "Shards whose advisory lock this process holds")
        self._ready_gauge = gauge(
            "ready", "1 while this process holds shards or is a live standby (see /readyz)"
        )
        self._ready_gauge.set_function(lambda: 1.0 if self.ready() else 0.0)
        self._beats: dict[int, float] = {}
        self._leases: dict[int, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def _gauge(self, name: str, documentation: str) -> Any:
        return self._prom.Gauge(f"outbox_relay_{name}", documentation, registry=self.registry)

    def published(self, count: int) -> None:
        self._published.inc(count)

    def failed(self, reason: str, count: int = 1) -> None:
        self._failed.labels(reason=reason).inc(count)

    def batch_seconds(self, seconds: float) -> None:
        self._latency.observe(seconds)

    def backlog(self, rows: int, oldest_age_s: float) -> None:
        self._backlog.set(rows)
        self._oldest.set(oldest_age_s)

    def heartbeat(self, worker: int) -> None:
        with self._lock:
            self._beats[worker] = time.monotonic()

    def worker_done(self, worker: int) -> None:
        with self._lock:
            self._beats.pop(worker, None)
            self._leases.pop(worker, None)
            self._shards.set(sum(owned for _, owned in self._leases.values()))

    def lease_checked(self, worker: int, owned: int) -> None:
        with self._lock:
            self._leases[worker] = (time.monotonic(), owned)
            self._shards.set(sum(n for _, n in self._leases.values()))

    def ready(self) -> bool:
        now = time.monotonic()
        with self._lock:
            return any(now - at < READY_STALE_S for at, _ in self._leases.values())

    def healthy(self) -> bool:
        now = time.monotonic()
        with self._lock:
            return all(now - beat < HEALTH_STALE_S for beat in self._beats.values())

    def exposition(self) -> bytes:
        data: bytes = self._prom.generate_latest(self.registry)
        return data


class CdcObserver(PrometheusObserver):
    """Plus the slot gauges. A CDC relay holds no leases: ready while healthy and under the
    slot lag warnings, a signal for the operator, not a restart trigger."""

    def __init__(self, lag_warn_bytes: int, lag_warn_s: float) -> None:
        super().__init__()
        self._slot_bytes = self._gauge("slot_lag_bytes", "WAL the relay's slot retains")
        self._slot_seconds = self._gauge(
            "slot_lag_seconds",
            "Age of the oldest outbox transaction streamed and not yet confirmed",
        )
        self._slot_active = self._gauge("slot_active", "1 while a relay streams from the slot")
        self._warn = (lag_warn_bytes, lag_warn_s)
        self._lag: tuple[int, float] = (0, 0.0)
        self._lag_lock = threading.Lock()

    def slot(self, lag_bytes: int, lag_s: float, active: bool) -> None:
        self._slot_bytes.set(lag_bytes)
        self._slot_seconds.set(lag_s)
        self._slot_active.set(1 if active else 0)
        with self._lag_lock:
            self._lag = (lag_bytes, lag_s)

    def ready(self) -> bool:
        if not self.healthy():
            return False
        with self._lag_lock:
            lag_bytes, lag_s = self._lag
        return lag_bytes <= self._warn[0] and lag_s <= self._warn[1]


def serve(observer: PrometheusObserver, host: str, port: int) -> ThreadingHTTPServer:
    probes = (
        ("/healthz", "healthy", b"ok\n", b"stale\n"),
        ("/readyz", "ready", b"ready\n", b"no lease check\n"),
    )

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, status, kind = b"not found\n", 404, "text/plain"
            if self.path.startswith("/metrics"):
                body, status, kind = observer.exposition(), 200, "text/plain; version=0.0.4"
            for path, check, good, bad in probes:
                if self.path.startswith(path):
                    ok = getattr(observer, check)()
                    body, status = (good, 200) if ok else (bad, 503)
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        raise RelayError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    thread = threading.Thread(target=server.serve_forever, name="relay-http", daemon=True)
    thread.start()
    return server
