"""What a CDC relay run did: counters shared by the stream loop, the marks and the backlog."""

from __future__ import annotations

from dataclasses import dataclass

from outbox_migrate.relay.run_stats import Counters


@dataclass
class CdcStats(Counters):
    """What a CDC run did; read it after `run()` returns (or live, for tests)."""

    published: int = 0
    batches: int = 0
    transactions: int = 0
    backlog: int = 0
    """Rows published from the exported snapshot at the slot's creation."""
    marked: int = 0
    marks: int = 0
    """Mark statements sent (one per mark interval under steady load)."""
    rejected: int = 0
    bad_rows: int = 0
    """Failures of a row itself (headers that are not an object, a message the sink cannot
    represent, a mark that breaks a constraint): counted like rejections, without backoff."""
    dead_lettered: int = 0
    sink_failures: int = 0
    reconnects: int = 0
    remarks: int = 0
    """Marks whose snapshot did not show a transaction the stream had sent yet: its rows
    went into the next mark (relay/cdc/marks.py)."""
    idle_confirms: int = 0
    confirmed_lsn: int = 0


@dataclass
class Unconfirmed:
    """Shared by the stream loop (writer) and the lag sampler (reader)."""

    commit_time: int | None = None
    """Commit time (pgoutput's microseconds) of the oldest outbox transaction received and
    not yet confirmed; None when everything received is confirmed."""
