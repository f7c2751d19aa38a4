"""Runner errors: each carries the facts the operator needs and maps to one exit code.

The lock budget's own errors (`Blocker`, `LockBudgetExceeded`) live with the primitive in
`outbox_migrate.lock_budget` and are re-exported here for the runner's callers."""

from __future__ import annotations

from outbox_migrate.errors import ExitCode, OutboxMigrateError, UsageError
from outbox_migrate.lock_budget import Blocker, LockBudgetExceeded

__all__ = [
    "Blocker",
    "LockBudgetExceeded",
    "LongTransactionsPresent",
    "OutOfOrder",
    "PreconditionFailed",
    "RunnerBusy",
    "StepChanged",
    "StepFailed",
    "VerifyFailed",
]


class PreconditionFailed(OutboxMigrateError):
    exit_code = ExitCode.PRECONDITION

    def __init__(self, step_id: str, condition: str, observed: str) -> None:
        self.step_id = step_id
        self.condition = condition
        self.observed = observed
        super().__init__(f"{step_id}: precondition {condition} failed: {observed}")


class LongTransactionsPresent(OutboxMigrateError):
    exit_code = ExitCode.LOCK_BUDGET

    def __init__(self, step_id: str, blockers: list[Blocker]) -> None:
        self.step_id = step_id
        self.blockers = blockers
        seen = [b for b in blockers if not b.hidden_from]
        if seen:
            message = (
                f"{step_id}: refusing to queue an ACCESS EXCLUSIVE lock behind "
                + ", ".join(b.describe() for b in seen[:3])
                + "; every writer would stall behind it — end them or use --on-long-tx wait"
            )
        else:
            # Their state is hidden from our role: "no long transaction" is not known, so the
            # guard refuses rather than pass on what it cannot see.
            message = (
                f"{step_id}: cannot tell whether the sessions holding locks it needs are long "
                "transactions: "
                + ", ".join(b.describe() for b in blockers[:3])
                + "; nothing was applied"
            )
        super().__init__(message)


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
