"""A worker's idle flag as a pure state machine: when to raise it, keep it, lower it, sleep
(docs/relay.md, "Why the trigger is usually quiet"). No I/O: the worker sends the locks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

BUSY_POLL_CAP_S = 0.05
"""A worker that could not raise the flag (an uncommitted writer saw the relay busy) looks
again after linger, doubling up to this: the late-row bound."""
SPARSE_ROWS = 8
"""A claim with the flag up of at most this many rows is a trickle (each row would wake an
idle relay anyway): the flag stays up. More, and it comes down: dense writers skip NOTIFY."""
AWAKE_WAITS = 2
"""Idle waits in a row that never had to block mean continuous traffic: the flag comes down,
or every writer keeps paying a NOTIFY, slowed until the claims look like a trickle for good."""


class Idle(enum.Enum):
    """What an idle worker does next (`IdleFlag.idle`, `IdleFlag.in_run`)."""

    CLAIM = "claim"
    RAISE = "raise"  # then claim once more with it up
    SLEEP = "sleep"  # the flag is up and confirmed
    BUSY_POLL = "busy-poll"  # the flag could not be raised: look again soon


@dataclass
class IdleFlag:
    """One worker's idle flag. `enabled`: notifications are on (not with `until_empty`)."""

    enabled: bool
    linger_s: float
    key: int | None = None
    """The flag this session holds, or None."""
    run_key: int = 0
    sleeping: bool = False
    """Raised, and the confirming claim came back empty."""
    busy_polls: int = 0
    sparse: bool = False
    empty: bool = False
    awake: int = 0
    tried: bool = False
    """The last claim went out with the flag up, or trying to raise it."""

    @property
    def held(self) -> bool:
        return self.key is not None

    def session_lost(self) -> None:
        self.key, self.sleeping = None, False

    def looked_up(self) -> None:
        self.busy_polls = 0

    def raised(self, key: int) -> None:
        self.key, self.sleeping, self.busy_polls = key, False, 0

    def lower(self) -> int | None:
        """The key to unlock (None: the flag was not up)."""
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
        """An uncommitted writer (which will not notify) or another worker holds the flag:
        look again soon, not at the poll interval."""
        self.busy_polls += 1
        return self.busy_poll_s()

    # -- inside a run of batches (`BatchLoop._claim` and `_wait_in_run`) -----------------

    def before_claim(self, flag_rows: int) -> tuple[int | None, bool]:
        """(The key to unlock with the claim, or None; whether to try raising `run_key`)."""
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
