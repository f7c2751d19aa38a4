"""Errors raised by the maintenance job; each names the facts an operator needs."""

from __future__ import annotations

from outbox_migrate.errors import ExitCode, OutboxMigrateError


class MaintenanceError(OutboxMigrateError):
    """Maintenance cannot run as asked (missing table, unavailable measurement)."""

    exit_code = ExitCode.USAGE


class ReindexRefused(OutboxMigrateError):
    """A REINDEX CONCURRENTLY was not started because a transaction would block it."""

    exit_code = ExitCode.PRECONDITION


class ReindexFailed(OutboxMigrateError):
    """REINDEX CONCURRENTLY failed; any invalid leftover index has been dropped."""

    exit_code = ExitCode.FAILED


class MaintenanceProblems(OutboxMigrateError):
    """A pass finished but left something for an operator (refused or failed rebuild)."""

    def __init__(self, problems: list[str], *, failed: bool) -> None:
        self.problems = problems
        self.exit_code = ExitCode.FAILED if failed else ExitCode.PRECONDITION
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"{problems[0]}{more}")
