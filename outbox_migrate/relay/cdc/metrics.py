"""CDC mode's observability: the slot's lag and activity, and readiness that follows them.

A CDC relay holds no shard leases, so the polling relay's readiness ("holds shards or is a
live standby") does not apply. Its readiness is: the stream loop reported within the health
window, and the slot retains less than the warning thresholds (bytes of WAL behind the
server, seconds since the oldest outbox transaction streamed and not yet confirmed). A
replica taken out of a load balancer does nothing for a lagging slot, so the threshold is a
signal for the operator (docs/relay.md, "Slot safety"), not a restart trigger: `/healthz`
stays liveness only.
"""

from __future__ import annotations

import threading

from outbox_migrate.relay.metrics import PrometheusObserver


class CdcObserver(PrometheusObserver):
    """PrometheusObserver plus the slot gauges; `ready()` is the CDC readiness above."""

    def __init__(self, lag_warn_bytes: int, lag_warn_s: float) -> None:
        super().__init__()
        prom = self._prom
        self._slot_bytes = prom.Gauge(
            "outbox_relay_slot_lag_bytes", "WAL the relay's slot retains", registry=self.registry
        )
        self._slot_seconds = prom.Gauge(
            "outbox_relay_slot_lag_seconds",
            "Age of the oldest outbox transaction streamed and not yet confirmed",
            registry=self.registry,
        )
        self._slot_active = prom.Gauge(
            "outbox_relay_slot_active", "1 while a relay streams from the slot",
            registry=self.registry,
        )  # fmt: skip
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
