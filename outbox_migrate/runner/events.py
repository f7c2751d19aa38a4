"""How the runner reports progress without printing: an events protocol the CLI implements
(rich progress for people, JSON lines for CI logs) and tests can record."""

from __future__ import annotations

from typing import Protocol

from outbox_migrate.lock_budget import AttemptLog
from outbox_migrate.patterns.model import Step


class RunnerEvents(Protocol):
    """Every event is optional: a class deriving from it hears only what it overrides.

    One more is looked up by name, so that implementations written before it (the benches'
    timelines) still fit: `interrupted(step, outcome)`, when a signal ended the command while
    `step` (or its inverse) was in hand — `committed`, `rolled-back`, `unfinished` (a step
    outside one transaction, partly done) or `unknown` (the session was busy: the ledger
    could not be asked). The CLI's `TrackedEvents` words the interrupt's line from it."""

    def step_started(self, step: Step, action: str) -> None:
        return None

    def attempt(self, step: Step, log: AttemptLog) -> None:
        return None

    def step_finished(self, step: Step, outcome: str, elapsed_s: float) -> None:
        return None

    def warning(self, step: Step, message: str) -> None:
        return None

    def progress(self, step: Step, done: int, total: int, rate_per_s: float) -> None:
        return None


class SilentEvents(RunnerEvents):
    """The default: record nothing, say nothing."""
