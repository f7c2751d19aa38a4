"""The package's one error hierarchy: errors that carry facts, and the exit code each maps to.
Core code raises these and never prints or exits; messages never contain a password (anything
from a DSN goes through `dsn.mask`). Below every other module, so any of them can raise these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum

SEE_OTHER_SESSIONS = "pg_read_all_stats"
"""The predefined role whose members see every session's activity (`pg_monitor` includes it)."""


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


def harness_missing(command: str, exc: ModuleNotFoundError) -> UsageError:
    """`demo` and `rehearse` run the proof harness, a distribution of its own (harness/) that a
    production install leaves out; any other missing module is not this error's to explain."""
    if not (exc.name or "").startswith("outbox_migrate_harness"):
        raise exc
    return UsageError(
        f"{command} needs the proof harness: pip install 'outbox-migrate[demo]' "
        "(from a checkout: pip install '.[demo]' ./harness)"
    )


class UsageError(OutboxMigrateError):
    """A request that makes no sense in the current state (unknown pattern, step out of order,
    maintenance of a table without partitions, an unavailable measurement)."""

    exit_code = ExitCode.USAGE


class ConnectionLost(OutboxMigrateError):
    """The server connection broke mid-command. Raised only where a re-run converges: a
    transactional step committed with its ledger row or not at all, and a non-transactional
    one is proven by its postcondition."""

    exit_code = ExitCode.CONNECTION_LOST

    def __init__(self, doing: str, cause: str) -> None:
        self.doing = doing
        self.cause = cause
        super().__init__(
            f"lost the database connection during {doing} ({cause}); nothing is half-applied "
            "— re-run the same command"
        )


class EmbeddedServerError(OutboxMigrateError):
    exit_code = ExitCode.FAILED


class NothingDone(OutboxMigrateError):
    """The command did not do what was asked, and says so (exit 1) so that a script or a CI
    gate does not carry on as if it had: `verify` found no migration in the ledger (a typo in
    --table, the wrong database: a gate must not pass on nothing), a selection matched no
    dead letter, a confirmation was answered no."""

    exit_code = ExitCode.FAILED


# -- the runner: steps, the lock budget, the sessions that block it ----------------------


@dataclass(frozen=True)
class Blocker:
    """A session holding a lock our step needs (from pg_locks + pg_stat_activity)."""

    pid: int
    application_name: str
    state: str
    xact_age_s: float | None
    mode: str
    relation: str
    hidden_from: str = ""
    """The role we run as, when the session is another role's and its activity (state,
    transaction start) is hidden from it; empty when we see it."""

    def describe(self) -> str:
        age = f", transaction open {self.xact_age_s:.1f} s" if self.xact_age_s is not None else ""
        app = self.application_name or "(no application_name)"
        state = shown_state(self.state, self.hidden_from)
        return f"pid {self.pid} ({app}, {state}{age}, {self.mode} on {self.relation})"


def shown_state(state: str, hidden_from: str) -> str:
    """A session's state, or that `hidden_from` (our role) cannot see it and what would show it."""
    return f"state hidden from {hidden_from}: {grant_to_see(hidden_from)}" if hidden_from else state


def grant_to_see(role: str) -> str:
    """What lets `role` see other roles' sessions: the one-line advice of every refusal."""
    return (
        f"GRANT {SEE_OTHER_SESSIONS} TO {role} (or pg_monitor), or run as a role that can see them"
    )


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
            f"{step_id}: could not take its locks in {attempts} "
            f"attempt{'' if attempts == 1 else 's'} over {waited_s:.1f} s"
            f"{who}; nothing was applied — retry when they finish"
        )


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
    """Another process runs the same migration or job (it holds its session advisory lock)."""

    exit_code = ExitCode.BUSY


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


def first_of(items: Sequence[object]) -> str:
    """The first of `items`, and how many more there are: `x (+2 more)`."""
    return f"{items[0]}" + (f" (+{len(items) - 1} more)" if len(items) > 1 else "")


class VerifyFailed(OutboxMigrateError):
    exit_code = ExitCode.FAILED

    def __init__(self, phase: str, violations: list[str]) -> None:
        self.phase, self.violations = phase, violations
        super().__init__(f"invariants of phase {phase} do not hold: {first_of(violations)}")


# -- the maintenance job ---------------------------------------------------------------


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
        super().__init__(first_of(problems))


# -- the relay and its sinks -----------------------------------------------------------


class RelayError(OutboxMigrateError):
    """The relay cannot run as configured (bad sink options, missing table or column)."""

    exit_code = ExitCode.USAGE


class RelayFailed(OutboxMigrateError):
    """The relay stopped on a fault met while running (exit 1): not bad input, which is
    refused before any work starts (`RelayError`, exit 2)."""

    exit_code = ExitCode.FAILED


class SinkCrashed(RelayFailed):
    """The sink raised something outside its protocol (not a `SinkError`: a serializer's bug,
    a client library's assertion) while it held the messages `ids` of source `label`. The
    relay stops (exit 1) and the attempt counts against those messages (relay/bad_rows.py
    says why), so one message that breaks a sink does not stop the outbox for ever."""

    def __init__(
        self, sink: str, label: str, ids: Sequence[int | str], cause: BaseException
    ) -> None:
        self.label = label
        self.ids = list(ids)
        self.reason = crash_reason(cause)
        super().__init__(f"sink {sink} failed: {self.reason}")


def crash_reason(exc: BaseException) -> str:
    """How a sink's unexpected exception is kept as a message's last error."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class SinkError(OutboxMigrateError):
    exit_code = ExitCode.FAILED


class SinkUnavailable(SinkError):
    """The broker did not acknowledge the batch (down, timeout): retry later with backoff.
    No message of it may be marked published but `acknowledged`, those the sink knows were
    delivered (the HTTP sink after some 2xx answers): the relay marks them, so they are not
    sent twice."""

    def __init__(self, sink: str, reason: str, acknowledged: Sequence[int | str] = ()) -> None:
        self.sink = sink
        self.reason = reason
        self.acknowledged = list(acknowledged)
        super().__init__(f"sink {sink} unavailable: {reason}")


class MessagesRejected(SinkError):
    """Some messages were refused (permanently or not); every other one was acknowledged:
    the relay marks those and counts an attempt against the refused ones."""

    def __init__(self, sink: str, rejected: Mapping[int | str, str]) -> None:
        self.sink = sink
        self.rejected = dict(rejected)
        first = next(iter(self.rejected.items()), (0, ""))
        super().__init__(
            f"sink {sink} rejected {len(self.rejected)} message(s), e.g. id {first[0]}: {first[1]}"
        )


class UnrepresentableMessage(SinkError):
    """A message's payload is raw bytes (bytea, not UTF-8) and the sink needs text. Retrying
    cannot change the row, so the relay rejects this message alone (counted, then
    dead-lettered with `reason`); the rest of the batch flows."""

    def __init__(self, reason: str, message_id: int | str | None = None) -> None:
        self.reason = reason
        self.message_id = message_id
        where = "" if message_id is None else f" (id {message_id})"
        super().__init__(f"message cannot be represented{where}: {reason}")


class NamesMoved(RelayFailed):
    """A name the relay was started with no longer means the relation it meant then (a
    rename, or its rollback, under a running relay): its marks would reach another table's
    rows by ctid. The relay stops (exit 1) rather than publish what it can no longer mark."""


class MarkFellShort(RelayFailed):
    """A mark changed fewer rows than the batch claimed and locked: the worker looks at its
    names (`marker_source.check_names`). Its rows stay unpublished and are claimed again."""

    def __init__(self, label: str, expected: int, changed: int) -> None:
        self.label = label
        super().__init__(f"the mark of {expected} claimed row(s) of {label} changed {changed}")
