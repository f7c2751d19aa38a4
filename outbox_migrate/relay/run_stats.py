"""What a relay run did, counted by its threads (`Relay.stats`, the `relay.stopped` line); a
module of its own so that a part that counts needs no relay lifecycle import.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outbox_migrate.relay.metrics import Observer


@dataclass
class Counters:
    """Every public field is an int."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    published: int = 0
    batches: int = 0
    sink_failures: int = 0
    rejected: int = 0
    bad_rows: int = 0
    """Failures of a row itself: counted like rejections, without the backoff."""
    dead_lettered: int = 0

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


def count_failures(
    stats: Counters, observer: Observer, *, rejected: int = 0, bad: int = 0, dead: int = 0,
    sink: int = 0,
) -> None:  # fmt: skip
    """Failures of either delivery style, in the run's counters and the metrics alike."""
    stats.add(rejected=rejected, bad_rows=bad, dead_lettered=dead, sink_failures=sink)
    for reason, count in (("rejected", rejected), ("bad_row", bad), ("sink", sink)):
        if count:
            observer.failed(reason, count)


@dataclass
class RelayStats(Counters):
    """What a polling run did; read it after `run()` returns (or live, for tests)."""

    serialization_retries: int = 0
    connection_retries: int = 0
    switches: int = 0
    abandoned_workers: int = 0
    read_ahead: int = 0

    def batch(self, published: int) -> None:
        """One batch committed (per batch: no keyword dispatch)."""
        with self._lock:
            self.published += published
            self.batches += 1


@dataclass
class CdcStats(Counters):
    """What a CDC run did; read it after `run()` returns (or live, for tests)."""

    transactions: int = 0
    backlog: int = 0
    marked: int = 0
    marks: int = 0
    reconnects: int = 0
    remarks: int = 0
    """Marks whose snapshot missed a transaction the stream had sent (relay/cdc/marks.py)."""
    idle_confirms: int = 0
    confirmed_lsn: int = 0


@dataclass
class Unconfirmed:
    """CDC: shared by the stream loop (writer) and the lag sampler (reader)."""

    commit_time: int | None = None
    """Commit time (pgoutput's) of the oldest outbox transaction not yet confirmed."""
