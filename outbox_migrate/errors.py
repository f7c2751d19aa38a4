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


class UsageError(OutboxMigrateError):
    """A request that makes no sense in the current state (unknown pattern, step out of order)."""

    exit_code = ExitCode.USAGE


class EmbeddedServerError(OutboxMigrateError):
    """The embedded PostgreSQL could not be installed or started."""

    exit_code = ExitCode.FAILED
