"""What a relay run did, counted by its threads (`Relay.stats`, the `relay.stopped` line).

One way to count for both relays: `Counters` (thread-safe `add`, `as_dict` for the log line
and the CLI) is the base of the polling relay's `RelayStats` here and of the CDC relay's
`CdcStats` (relay/cdc/stats.py), which keep only their own counters. Its own module so that
every part of the relay that counts (the workers, the rejection policy in relay/refusals.py)
can without importing the relay's lifecycle (relay/worker.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Counters:
    """A run's counters, added to by several threads; every public field is an int."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


@dataclass
class RelayStats(Counters):
    """What a polling run did; read it after `run()` returns (or live, for tests)."""

    published: int = 0
    batches: int = 0
    serialization_retries: int = 0
    connection_retries: int = 0
    sink_failures: int = 0
    rejected: int = 0
    bad_rows: int = 0
    """Failures of a row itself (relay/claimed.py, an unrepresentable message, a mark that
    violates a constraint): counted like rejections, without the backoff."""
    dead_lettered: int = 0
    switches: int = 0
    abandoned_workers: int = 0
    read_ahead: int = 0
    """Batches claimed on a worker's read-ahead session while the one before was published."""

    def batch(self, published: int) -> None:
        """One batch committed (the per-batch path: no keyword dispatch)."""
        with self._lock:
            self.published += published
            self.batches += 1
