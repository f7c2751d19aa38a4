"""A worker's idle flag as a pure state machine: when to raise it, keep it, lower it, sleep.

The flag is a session advisory lock (patterns/notify.py): while a relay holds it, the wake-up
trigger notifies at every writer's commit; while the relay claims, writers commit without a
NOTIFY. One method per event and no I/O: the worker sends the lock statements this returns
and reports what came back, so the rules are unit-tested without a server.

It must not: talk to PostgreSQL, sleep, or know about batches beyond their row counts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

BUSY_POLL_CAP_S = 0.05
"""An idle worker that could not raise the idle flag (a writer that saw the relay busy has not
committed yet) looks again after linger, doubling up to this: the late-row bound."""
SPARSE_ROWS = 8
"""A claim made with the idle flag up that returned at most this many rows is a trickle: rows
arrive a few at a time and each would wake an idle relay anyway, so the flag stays up and the
worker sleeps right after publishing (patterns/notify.py). More rows than this, and the flag comes
down: writers of dense traffic commit without NOTIFY."""
AWAKE_WAITS = 2
"""Idle waits in a row that found a notification already there (the worker never had to
sleep): the traffic is continuous, not a trickle, and the flag comes down — otherwise every
writer would keep paying a NOTIFY at its commit, which at tens of thousands of commits a second
slows them down until the relay's claims look like a trickle for good (bench section 7)."""


class Idle(enum.Enum):
    """What an idle worker does next (`IdleFlag.idle`, `IdleFlag.in_run`)."""

    CLAIM = "claim"
    """Claim again now (outside a run: after raising the flag; inside: what is queued goes
    with it)."""
    RAISE = "raise"
    """Try to raise the flag (then claim once more with it up)."""
    SLEEP = "sleep"
    """Sleep until notified or the poll interval: the flag is up and confirmed."""
    BUSY_POLL = "busy-poll"
    """The flag could not be raised: look again soon (`busy_poll_s`)."""


@dataclass
class IdleFlag:
    """One worker's idle flag. `enabled`: notifications are on (not with `until_empty`)."""

    enabled: bool
    linger_s: float
    key: int | None = None
    """The flag this session holds, or None."""
    run_key: int = 0
    """The flag's key for the source of the current run (`notify.idle_lock_key`)."""
    sleeping: bool = False
    """The flag was raised and the confirming claim came back empty: the worker sleeps."""
    busy_polls: int = 0
    sparse: bool = False
    """The last claim returned at most the run's `flag_rows` rows: a held flag may stay up."""
    empty: bool = False
    """The last claim returned nothing: the next one raises the flag."""
    awake: int = 0
    """Idle waits in a row that did not have to block (see AWAKE_WAITS)."""
    tried: bool = False
    """The last claim went out with the flag up, or with an attempt to raise it."""

    @property
    def held(self) -> bool:
        return self.key is not None

    def session_lost(self) -> None:
        """Session advisory locks die with their session."""
        self.key, self.sleeping = None, False

    def looked_up(self) -> None:
        """The worker went back to its loop's top (stop, lease check, switch)."""
        self.busy_polls = 0

    def raised(self, key: int) -> None:
        self.key, self.sleeping, self.busy_polls = key, False, 0

    def lower(self) -> int | None:
        """Lower the flag; returns the key to unlock (None: it was not up)."""
        key = self.key
        if key is not None:
            self.key, self.sleeping = None, False
        return key

    def busy_poll_s(self) -> float:
        linger = max(self.linger_s, 0.001)
        return float(min(linger * 2 ** min(self.busy_polls, 16), BUSY_POLL_CAP_S))

    # -- outside a run of batches (the worker's `_idle`) -----------------------------------

    def idle(self) -> Idle:
        """Nothing to claim, outside a run: SLEEP, RAISE (then `raised` or `not_raised`)."""
        if not self.enabled or self.sleeping:
            return Idle.SLEEP
        if self.key is not None:
            self.sleeping = True  # the flag is up and the claim after raising it found nothing
            return Idle.SLEEP
        return Idle.RAISE

    def not_raised(self) -> float:
        """A writer that saw the relay busy has not committed yet (it holds the flag's lock
        shared and will not notify), or another worker holds the flag: how long until the
        worker looks again — soon, not at the poll interval."""
        self.busy_polls += 1
        return self.busy_poll_s()

    # -- inside a run of batches (`BatchLoop._claim` and `_wait_in_run`) -----------------

    def before_claim(self, flag_rows: int) -> tuple[int | None, bool]:
        """A claim is about to go out: (the key to unlock with it or None, whether to try
        raising `run_key` with it). `flag_rows` < 0: the flag is only raised outside runs."""
        unlock, raising = None, False
        if flag_rows < 0:
            if self.sleeping:
                unlock = self.lower()  # woken: claiming now, writers need not notify
        elif self.key is not None:
            if not self.sparse or self.awake >= AWAKE_WAITS:
                unlock = self.lower()
        elif self.empty:
            raising = True
        self.tried = self.key is not None or raising
        return unlock, raising

    def claimed(self, rows: int, flag_rows: int) -> None:
        self.sparse, self.empty = rows <= flag_rows, not rows

    def claimed_ahead(self, rows: int) -> None:
        """A read-ahead claim (made with the flag down, after a full batch) came back."""
        self.sparse = self.empty = not rows

    def in_run(self, claim_due: bool) -> Idle:
        """Nothing more to claim now, inside a run: CLAIM (a claim below the cursor is due,
        or the last claim did not try to raise the flag), SLEEP with the flag up, or
        BUSY_POLL (`busy_poll_s`) after a claim that failed to raise it."""
        if claim_due or (self.key is None and not self.tried):
            return Idle.CLAIM
        if self.key is not None:
            self.sleeping = True
            return Idle.SLEEP
        self.busy_polls += 1
        return Idle.BUSY_POLL

    def slept(self, *, blocked: bool) -> None:
        """An idle wait with the flag up ended; `blocked`: it had to block before it did."""
        self.awake = 0 if blocked else self.awake + 1
