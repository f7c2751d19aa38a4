"""Errors that carry facts, and the exit code each maps to.

Core code raises these and never prints or exits; the CLI turns them into one line on stderr
and the exit code below. Messages must never contain a password: anything derived from a DSN
goes through `outbox_migrate.dsn.mask` before it lands here.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit codes shared by every command (documented in docs/cli.md)."""

    OK = 0
    FAILED = 1  # the operation ran and failed (a step error, a verification mismatch)
    USAGE = 2  # bad input: configuration, DSN, unknown table, wrong schema, step out of order
    BUSY = 3  # another runner holds the migration's advisory lock
    LOCK_BUDGET = 4  # a lock could not be taken within the step's budget; nothing was applied
    PRECONDITION = 5  # a precondition on the live database does not hold
    CONNECTION_LOST = 6  # the database connection broke mid-command; nothing half-applied
    INTERRUPTED = 130  # SIGINT (Ctrl-C): the current step was left consistent, then we stopped
    TERMINATED = 143  # SIGTERM: as for SIGINT


class OutboxMigrateError(Exception):
    """Base class: `str(err)` is the one-line message the CLI prints."""

    exit_code: ExitCode = ExitCode.FAILED


class ConfigError(OutboxMigrateError):
    """Invalid configuration: names the key and the source it came from."""

    exit_code = ExitCode.USAGE

    def __init__(self, key: str, source: str, problem: str) -> None:
        self.key = key
        self.source = source
        self.problem = problem
        super().__init__(f"invalid configuration {key!r} (from {source}): {problem}")


class ConnectError(OutboxMigrateError):
    """The database could not be reached or refused us; the DSN in the message is masked."""

    exit_code = ExitCode.USAGE


class SchemaError(OutboxMigrateError):
    """The live schema cannot be migrated as asked (missing table, wrong types, an FK into it)."""

    exit_code = ExitCode.USAGE


class Blocked(SchemaError):
    """Several blockers at once: `str(err)` is one line that counts them, and `details`
    holds one line per blocker with its fix, which the CLI prints above it, so a user fixes
    them all in one round instead of one per run."""

    def __init__(self, summary: str, details: list[str]) -> None:
        self.details = details
        super().__init__("\n".join([summary, *details]))


class UsageError(OutboxMigrateError):
    """A request that makes no sense in the current state (unknown pattern, step out of order)."""

    exit_code = ExitCode.USAGE


class ConnectionLost(OutboxMigrateError):
    """The server connection broke (server restart, terminated backend, network) mid-command.

    Raised by core code that knows what it was doing, so the one line names the step. The
    runner only raises it where a re-run converges: a transactional step either committed with
    its ledger row or not at all, and a non-transactional one is proven by its postcondition.
    """

    exit_code = ExitCode.CONNECTION_LOST

    def __init__(self, doing: str, cause: str) -> None:
        self.doing = doing
        self.cause = cause
        super().__init__(
            f"lost the database connection during {doing} ({cause}); nothing is half-applied "
            "— re-run the same command"
        )


class EmbeddedServerError(OutboxMigrateError):
    """The embedded PostgreSQL could not be installed or started."""

    exit_code = ExitCode.FAILED


class NothingRecorded(OutboxMigrateError):
    """`verify` found no migration in the ledger for the table: nothing can be verified, and
    a CI gate must not pass on nothing (a typo in --table, the wrong database)."""

    exit_code = ExitCode.FAILED
