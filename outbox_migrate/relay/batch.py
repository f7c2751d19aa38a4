"""One batch of the relay's hot loop and the polling worker's state around it, as data
(docs/relay.md, "How it is built"). Nothing here publishes, waits or reads results.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Any

from outbox_migrate.errors import MarkFellShort
from outbox_migrate.relay import queries, wire
from outbox_migrate.relay.bad_rows import DeadLetter
from outbox_migrate.relay.message import Message, MessageId

_CTID = operator.itemgetter(queries.CLAIM_CTID_COLUMN)


@dataclass(slots=True)
class Batch:
    """Rows claimed by one claim, through publish to mark."""

    source: queries.Source
    mark: bytes
    rows: list[Any]
    after: int
    started: float
    """perf_counter when the claim was sent: the batch's time starts there."""
    messages: list[Message] = field(default_factory=list)
    acked: list[MessageId] = field(default_factory=list)
    letters: list[DeadLetter] = field(default_factory=list)
    """Dead-lettered in this transaction, their rows settled apart from the batch's mark;
    logged once the COMMIT succeeded, written again by the repair if the mark failed."""

    def to_mark(self) -> list[str]:
        rows, acked = self.rows, self.acked
        if len(acked) == len(rows):
            return list(map(_CTID, rows))
        wanted = set(acked)
        return [r[queries.CLAIM_CTID_COLUMN] for r in rows if r[0] in wanted]


@dataclass(slots=True)
class Commit:
    """A batch whose mark and COMMIT were queued; it counts once both succeeded."""

    batch: Batch
    commit: wire.Slot
    published: int
    mark: wire.Slot | None = None
    """None: nothing to mark. Failed: the COMMIT rolled back, rows published and unmarked."""
    sent: float = 0.0
    """When it started to linger or sleep (0: no linger): the batch's time ends there."""
    marking: int = 0
    """Rows the mark was given, all locked by this transaction: fewer changed means its name
    no longer reaches them (`fell_short`)."""

    @property
    def succeeded(self) -> bool:
        return self.commit.succeeded and not self.mark_failed

    @property
    def mark_failed(self) -> bool:
        return self.mark is not None and self.mark.failed

    def fell_short(self) -> MarkFellShort | None:
        """The error when the mark changed fewer rows than given (a failed one is repaired)."""
        mark = self.mark
        if mark is None or mark.result is None or not mark.succeeded:
            return None
        changed = mark.result.command_tuples
        if changed is None or changed >= self.marking:
            return None
        return MarkFellShort(self.batch.source.label, self.marking, changed)


def mark_and_commit(pipe: wire.Wire, batch: Batch) -> Commit:
    """Queue the mark and the COMMIT. The mark is tolerated: a row that breaks a constraint
    rolls back this batch only, and the next claim runs as usual."""
    tids = batch.to_mark()
    mark = None
    if tids:
        # An array literal: a list dumper would cost more than the mark.
        mark = pipe.send(batch.mark, {"tids": '{"' + '","'.join(tids) + '"}'}, tolerate=True)
    return Commit(batch, pipe.send_plain(b"COMMIT"), len(batch.acked), mark, marking=len(tids))


class Phase(enum.Enum):
    """What a polling worker is doing; `WorkerState` moves it (docs/relay.md)."""

    CONNECTING = "connecting"
    IDLE = "idle"
    CLAIMING = "claiming"
    PUBLISHING = "publishing"  # a batch is with the sink, its transaction open
    PARKED = "parked"  # the sink rejected messages: wait `pause_s` before the next claim
    BACKING_OFF = "backing off"
    SWITCHING = "switching"
    STOPPING = "stopping"  # final


@dataclass
class WorkerState:
    """A polling worker's phase and what a phase leaves for the next (docs/relay.md)."""

    phase: Phase = Phase.CONNECTING
    pause_s: float = 0.0
    failures: int = 0
    """Failed steps in a row (the backoff grows with them)."""
    later: list[MessageId] = field(default_factory=list)
    """Bad rows to try again once the backlog is drained."""
    unmarked: list[Commit] = field(default_factory=list)
    """Batches whose mark did not commit (repaired before a claim)."""
    mark_failure: Exception | None = None
    """The constraint a COMMIT broke (deferred)."""
    blocked: bool = False
    rewound: bool = False
    """The last batch set the cursor back (no read-ahead then)."""

    def to(self, phase: Phase) -> None:
        if self.phase is not Phase.STOPPING:
            self.phase = phase

    def park(self, pause_s: float) -> None:
        self.pause_s = pause_s
        self.to(Phase.PARKED)

    def unpark(self) -> float:
        """The pause to take now (0: none)."""
        pause, self.pause_s = self.pause_s, 0.0
        return pause

    def back_off(self) -> int:
        """A step failed: the failures before this one (the backoff's exponent)."""
        self.to(Phase.BACKING_OFF)
        self.failures += 1
        return self.failures - 1

    def served(self) -> None:
        self.failures = 0

    def must_repair(self) -> bool:
        return self.mark_failure is not None or bool(self.unmarked)
