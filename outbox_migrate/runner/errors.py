"""Runner errors: each carries the facts the operator needs and maps to one exit code."""

from __future__ import annotations

from dataclasses import dataclass

from outbox_migrate.errors import ExitCode, OutboxMigrateError, UsageError


@dataclass(frozen=True)
class Blocker:
    """A session holding a lock our step needs (from pg_locks + pg_stat_activity)."""

    pid: int
    application_name: str
    state: str
    xact_age_s: float | None
    mode: str
    relation: str

    def describe(self) -> str:
        age = f", transaction open {self.xact_age_s:.1f} s" if self.xact_age_s is not None else ""
        app = self.application_name or "(no application_name)"
        return f"pid {self.pid} ({app}, {self.state}{age}, {self.mode} on {self.relation})"


class PreconditionFailed(OutboxMigrateError):
    exit_code = ExitCode.PRECONDITION

    def __init__(self, step_id: str, condition: str, observed: str) -> None:
        self.step_id = step_id
        self.condition = condition
        self.observed = observed
        super().__init__(f"{step_id}: precondition {condition} failed: {observed}")


class LockBudgetExceeded(OutboxMigrateError):
    exit_code = ExitCode.LOCK_BUDGET

    def __init__(
        self, step_id: str, attempts: int, waited_s: float, blockers: list[Blocker]
    ) -> None:
        self.step_id = step_id
        self.attempts = attempts
        self.waited_s = waited_s
        self.blockers = blockers
        who = "; blocked by " + ", ".join(b.describe() for b in blockers[:3]) if blockers else ""
        super().__init__(
            f"{step_id}: could not take its locks in {attempts} attempts over {waited_s:.1f} s"
            f"{who}; nothing was applied — retry when they finish"
        )


class LongTransactionsPresent(OutboxMigrateError):
    exit_code = ExitCode.LOCK_BUDGET

    def __init__(self, step_id: str, blockers: list[Blocker]) -> None:
        self.step_id = step_id
        self.blockers = blockers
        super().__init__(
            f"{step_id}: refusing to queue an ACCESS EXCLUSIVE lock behind "
            + ", ".join(b.describe() for b in blockers[:3])
            + "; every writer would stall behind it — end them or use --on-long-tx wait"
        )


class RunnerBusy(OutboxMigrateError):
    exit_code = ExitCode.BUSY

    def __init__(self, table: str, holder: str) -> None:
        super().__init__(f"another runner is migrating {table}: {holder}")


class StepChanged(OutboxMigrateError):
    exit_code = ExitCode.USAGE

    def __init__(self, step_id: str, recorded: str, current: str) -> None:
        super().__init__(
            f"{step_id} was applied with definition {recorded} but is now {current}; "
            "the catalog or configuration changed after the step ran — restore it, or "
            "`outbox-migrate reset` to start over deliberately"
        )


class StepFailed(OutboxMigrateError):
    exit_code = ExitCode.FAILED

    def __init__(self, step_id: str, error: str) -> None:
        self.step_id = step_id
        super().__init__(f"{step_id} failed: {error}; it was rolled back, fix and re-run")


class OutOfOrder(UsageError):
    """A phase asked for before the deploy that must precede it."""


class VerifyFailed(OutboxMigrateError):
    exit_code = ExitCode.FAILED

    def __init__(self, phase: str, violations: list[str]) -> None:
        self.violations = violations
        more = f" (+{len(violations) - 1} more)" if len(violations) > 1 else ""
        super().__init__(f"invariants of phase {phase} do not hold: {violations[0]}{more}")
