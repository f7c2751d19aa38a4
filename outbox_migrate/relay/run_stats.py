"""What a relay run did, counted by its threads (`Relay.stats`, the `relay.stopped` line).

One way to count for both delivery styles: `Counters` (thread-safe `add`, `as_dict` for the
log line and the CLI) holds the counters every delivery has; the polling relay's `RelayStats`
and the CDC relay's `CdcStats` add only their own. Its own module so that every part of the
relay that counts (the workers, the rejection policy in relay/refusals.py, the CDC stream)
can without importing a relay's lifecycle.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Counters:
    """A run's counters, added to by several threads; every public field is an int."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    published: int = 0
    batches: int = 0
    sink_failures: int = 0
    rejected: int = 0
    bad_rows: int = 0
    """Failures of a row itself (relay/claimed.py, headers that are not an object, a message
    the sink cannot represent, a mark that violates a constraint): counted like rejections,
    without the backoff."""
    dead_lettered: int = 0

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

    serialization_retries: int = 0
    connection_retries: int = 0
    switches: int = 0
    abandoned_workers: int = 0
    read_ahead: int = 0
    """Batches claimed on a worker's read-ahead session while the one before was published."""

    def batch(self, published: int) -> None:
        """One batch committed (the per-batch path: no keyword dispatch)."""
        with self._lock:
            self.published += published
            self.batches += 1


@dataclass
class CdcStats(Counters):
    """What a CDC run did; read it after `run()` returns (or live, for tests)."""

    transactions: int = 0
    backlog: int = 0
    """Rows published from the exported snapshot at the slot's creation."""
    marked: int = 0
    marks: int = 0
    """Mark statements sent (one per mark interval under steady load)."""
    reconnects: int = 0
    remarks: int = 0
    """Marks whose snapshot did not show a transaction the stream had sent yet: its rows
    went into the next mark (relay/cdc/marks.py)."""
    idle_confirms: int = 0
    confirmed_lsn: int = 0


@dataclass
class Unconfirmed:
    """CDC: shared by the stream loop (writer) and the lag sampler (reader)."""

    commit_time: int | None = None
    """Commit time (pgoutput's microseconds) of the oldest outbox transaction received and
    not yet confirmed; None when everything received is confirmed."""
