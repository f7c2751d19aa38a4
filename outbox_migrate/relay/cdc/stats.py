"""What a CDC relay run did: counters shared by the stream loop, the marks and the backlog."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class CdcStats:
    """What a run did; read it after `run()` returns (or live, for tests)."""

    published: int = 0
    batches: int = 0
    transactions: int = 0
    backlog: int = 0
    """Rows published from the exported snapshot at the slot's creation."""
    marked: int = 0
    marks: int = 0
    """Mark statements sent (one per mark interval under steady load)."""
    dead_lettered: int = 0
    sink_failures: int = 0
    reconnects: int = 0
    idle_confirms: int = 0
    confirmed_lsn: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


@dataclass
class Unconfirmed:
    """Shared by the stream loop (writer) and the lag sampler (reader)."""

    commit_time: int | None = None
    """Commit time (pgoutput's microseconds) of the oldest outbox transaction received and
    not yet confirmed; None when everything received is confirmed."""
