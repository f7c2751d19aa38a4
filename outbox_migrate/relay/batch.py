"""One batch of the relay's hot loop, and the polling worker's state around it, as data.

`Batch`: what was claimed, what became a message, what the broker acknowledged, what was
refused or dead-lettered, what is marked — passed from claim to mark (and on to `mark_repair`
if the mark fails). `Commit` is a batch whose mark and COMMIT were queued on its session.
`WorkerState`: what a worker is doing (`Phase`) and what one phase leaves for the next, the
one place a worker's state is named and moved (relay/driver.py, relay/batch_loop.py).

It must not: publish, wait, or read results (the worker and relay/wire.py do).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from outbox_migrate.errors import MarkFellShort
from outbox_migrate.relay import claimed, queries, wire
from outbox_migrate.relay.bad_rows import DeadLetter
from outbox_migrate.relay.message import Message, MessageId


@dataclass(slots=True)
class Batch:
    """Rows claimed by one claim, through publish to mark."""

    source: queries.Source
    mark: bytes
    """The mark statement (rendered for the claiming session)."""
    rows: list[Any]
    """The claimed rows, as the claim returned them (id first, ctid at CLAIM_CTID_COLUMN)."""
    after: int
    """The id the range claim started after."""
    started: float
    """perf_counter when the claim was sent: the batch's time starts there."""
    messages: list[Message] = field(default_factory=list)
    bad: list[claimed.BadRow] = field(default_factory=list)
    """Rows that could not become a message (relay/claimed.py)."""
    acked: list[MessageId] = field(default_factory=list)
    """Acknowledged by the broker, to be marked."""
    letters: list[DeadLetter] = field(default_factory=list)
    """Dead-lettered in this transaction, their rows already marked or deleted — not by the
    batch's mark (relay/mark_repair.py `settle_dead`). Logged and counted once the COMMIT
    succeeded; written again by the repair when the batch's mark failed."""
    retry: list[MessageId] = field(default_factory=list)
    """Bad rows to claim again by id."""
    pause: float = 0.0
    """The worker's pause once this batch's transaction has ended (a rejection's backoff, a
    claim of parked keys only); 0: none."""
    rewind: MessageId | None = None
    """Claim again from this id (after a rejection's pause, for a released key)."""

    def to_mark(self) -> list[str]:
        """The ctids of the claimed rows that are acknowledged."""
        at = queries.CLAIM_CTID_COLUMN
        rows, acked = self.rows, self.acked
        if len(acked) == len(rows):
            return [r[at] for r in rows]
        wanted = set(acked)
        return [r[at] for r in rows if r[0] in wanted]


@dataclass(slots=True)
class Commit:
    """A batch whose mark and COMMIT were queued; it counts once both succeeded."""

    batch: Batch
    commit: wire.Slot
    published: int
    mark: wire.Slot | None = None
    """The mark's result (None: nothing to mark). When it failed, the COMMIT rolled the
    batch's transaction back: its rows are published and unmarked (`BatchLoop.repair`)."""
    sent: float = 0.0
    """When it started to linger or sleep (its mark and COMMIT sent, their result read with
    the next claim's); 0: no linger. The batch's time ends there."""
    marking: int = 0
    """How many rows the mark was given: claimed and locked by this transaction, so the mark
    changes each of them — fewer means its name no longer reaches them (`fell_short`)."""

    @property
    def succeeded(self) -> bool:
        return self.commit.succeeded and not self.mark_failed

    @property
    def mark_failed(self) -> bool:
        return self.mark is not None and self.mark.failed

    @property
    def started(self) -> float:
        return self.batch.started

    def fell_short(self) -> MarkFellShort | None:
        """When the mark changed fewer rows than it was given, what to raise (None: as many,
        or it failed — a failed mark is repaired instead)."""
        mark = self.mark
        if mark is None or mark.result is None or not mark.succeeded:
            return None
        changed = mark.result.command_tuples
        if changed is None or changed >= self.marking:
            return None
        return MarkFellShort(self.batch.source.label, self.marking, changed)


def mark_and_commit(pipe: wire.Wire, batch: Batch) -> Commit:
    """Queue the mark of the acknowledged rows, and the COMMIT, on the
    session that claimed them. The mark is tolerated (`Wire.send`): a row that breaks a
    constraint as it moves (a duplicate id after the swap) rolls back this batch only, and
    whatever the session has queued after it — the next claim — runs as usual."""
    tids = batch.to_mark()
    mark = None
    if tids:
        # An array literal: a list dumper would cost more than the mark.
        mark = pipe.send(batch.mark, {"tids": '{"' + '","'.join(tids) + '"}'}, tolerate=True)
    return Commit(batch, pipe.send_plain(b"COMMIT"), len(batch.acked), mark, marking=len(tids))


class Phase(enum.Enum):
    """What a polling worker is doing; `WorkerState` moves it (docs/relay.md)."""

    CONNECTING = "connecting"
    """No claim session: (re)open it, take shards."""
    IDLE = "idle"
    """Nothing to claim: asleep until notified, or the poll interval."""
    CLAIMING = "claiming"
    """A claim is on its way (with the last batch's mark and COMMIT)."""
    PUBLISHING = "publishing"
    """A claimed batch is with the sink, its transaction open."""
    PARKED = "parked"
    """The sink rejected messages: wait `pause_s` before the next claim."""
    BACKING_OFF = "backing off"
    """The database or the broker is out of reach (or a 40001): wait, then try again."""
    SWITCHING = "switching"
    """The flat table came back empty: moving to the partitioned one (relay/switching.py)."""
    STOPPING = "stopping"
    """The relay stops: finish the batch in hand, release the shards. Final."""


@dataclass
class WorkerState:
    """A polling worker's state: its phase and what a phase leaves for the next, one object
    shared by the worker (relay/driver.py) and its runs; every move is a method here."""

    phase: Phase = Phase.CONNECTING
    pause_s: float = 0.0
    """PARKED: wait before the next claim (the sink rejected messages to be retried)."""
    failures: int = 0
    """BACKING_OFF: failed steps in a row (the backoff grows with them)."""
    later: list[MessageId] = field(default_factory=list)
    """Bad rows to try again once the backlog is drained (`BatchLoop.retry_bad_rows`)."""
    unmarked: list[Commit] = field(default_factory=list)
    """Batches of the last failed run whose mark did not commit (repaired before a claim)."""
    mark_failure: Exception | None = None
    """The constraint a COMMIT broke (deferred): the next step repairs `unmarked` first."""
    blocked: bool = False
    """The last idle wait blocked before it returned (`Listener.poll`)."""
    rewound: bool = False
    """The last batch set the cursor back to a row to try again (no read-ahead then)."""

    def to(self, phase: Phase) -> None:
        """Move to `phase`; STOPPING is final."""
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
        """A run ended without failing: the backoff starts over."""
        self.failures = 0

    def must_repair(self) -> bool:
        return self.mark_failure is not None or bool(self.unmarked)
