"""Applying an admitted plan, one step at a time: locks, checks, DDL and ledger row in one
transaction. It decides nothing (`decide.py` did) and never prints or exits.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import psycopg
from psycopg import errors
from psycopg.pq import TransactionStatus

from outbox_migrate.config import Settings
from outbox_migrate.db import lock_timeout, one_line
from outbox_migrate.errors import (
    ConnectionLost,
    LongTransactionsPresent,
    PreconditionFailed,
    StepFailed,
)
from outbox_migrate.lock_budget import (
    AttemptLog,
    LockBudget,
    LockMode,
    lock_declared,
    long_transactions,
    run_with_lock_budget,
)
from outbox_migrate.patterns.model import CheckPoint, Condition, Step
from outbox_migrate.runner import ledger, ownership
from outbox_migrate.runner.checks import (
    before_transaction,
    check_conditions,
    violations,
)
from outbox_migrate.runner.decide import Action, action_for
from outbox_migrate.runner.events import RunnerEvents
from outbox_migrate.runner.executors import executor_for

FAULT_ENV = "OUTBOX_MIGRATE_FAULT"
"""Test hook: `<step-id>@<point>` SIGKILLs the runner at that point (before, after-ddl,
after-commit) so crash recovery can be tested at every instant. Unset in production."""

CONNECTION_SQLSTATES = ("08", "57P01", "57P02", "57P03")
"""Connection exceptions and server shutdowns: the session is gone, not the statement."""


def fault(step_id: str, point: str) -> None:
    wanted = os.environ.get(FAULT_ENV)
    if wanted and wanted == f"{step_id}@{point}":
        os.kill(os.getpid(), signal.SIGKILL)


def connection_lost(exc: BaseException, conn: psycopg.Connection[Any] | None) -> bool:
    """True when `exc` means the session is gone (server restart, terminated backend,
    network), as opposed to the statement failing on a live session."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = getattr(exc, "sqlstate", None) or ""
    if state.startswith(CONNECTION_SQLSTATES):
        return True
    return conn is not None and conn.closed


@dataclass
class RunResult:
    pattern: str
    phase: str
    ran: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    completed: bool = False
    inside: str | None = None
    """The phase after `phase` when some of its steps are done (`next` began it): the
    command stopped inside that phase, not at `phase`'s deploy boundary."""


class ApplyOptions(Protocol):
    """How steps are applied: the operator's choices for one command (the `Runner`'s)."""

    settings: Settings
    dsn: str
    events: RunnerEvents
    on_long_tx: str
    watch_blockers: bool
    copy_back_options: Any
    job_dsn: str | None


class StepApplier:
    """Carries out steps for one migration (`migration_id` None: an inverse of a step applied
    outside any ledger). The executors' `ApplyHost`."""

    def __init__(
        self, conn: psycopg.Connection[Any], options: ApplyOptions, migration_id: int | None
    ) -> None:
        self.conn = conn
        self.options = options
        self.spec = options.settings.spec
        self.events = options.events
        self.copy_back_options = options.copy_back_options
        self.job_dsn = options.job_dsn
        self.migration_id = migration_id
        self._started_at: datetime | None = None

    # -- the ApplyHost protocol -------------------------------------------------------------

    def violations(self, conditions: Iterable[Condition]) -> list[str]:
        return violations(self.conn, conditions)

    def transition(
        self, step: Step, target: str, *, error: str | None = None, started: bool = False,
        started_at: datetime | None = None,
    ) -> None:  # fmt: skip
        ledger.transition(
            self.conn, self._recording(), step.id, target, error=error, started=started,
            started_at=started_at,
        )  # fmt: skip

    def apply_in_transaction(self, step: Step) -> float:
        """Locks, then the checks that must hold at commit, then the DDL, the ledger row and
        the ownership records — one transaction; milliseconds lost waiting for locks."""
        migration_id = self._recording()

        def body(conn: psycopg.Connection[Any]) -> None:
            check_conditions(conn, step.id, step.conditions_at(CheckPoint.LOCKED))
            for statement in step.statements:
                conn.execute(statement)
            # The locks were taken first, so the order of these last writes does not
            # lengthen any lock hold; the ledger row commits with the DDL.
            ledger.transition(conn, migration_id, step.id, "done", started_at=self._started_at)
            ownership.record(conn, migration_id, step, self.spec, "created")
            fault(step.id, "after-ddl")

        return self.in_step_transaction(
            step, step.id, self.budget(step), body,
            on_attempt=lambda log: self._attempt(step, log),
        )  # fmt: skip

    def apply_autocommit(self, step: Step) -> float:
        """Statements that refuse a transaction block: run, then re-prove at the end — the
        postcondition, and every LOCKED precondition again — before recording done."""
        self.transition(step, "running", started=True)
        with lock_timeout(self.conn, self.options.settings.lock_timeout_ms):
            for statement in step.statements:
                self.conn.execute(statement)
        broken = self.violations(step.conditions_at(CheckPoint.LOCKED))
        if broken:  # each statement committed alone: nothing held them while it ran
            raise StepFailed(step.id, f"ran, but a precondition no longer holds: {broken[0]}")
        self.prove_done(step)
        return 0.0

    def prove_done(self, step: Step) -> None:
        problems = self.violations(step.postcondition)
        if problems:
            raise StepFailed(step.id, f"finished but not proven done: {problems[0]}")
        with self.conn.transaction():
            ownership.record(self.conn, self._recording(), step, self.spec, "created")
            self.transition(step, "done")

    # -- one step of an admitted plan -------------------------------------------------------

    def record_undone(self, step: Step, result: RunResult) -> None:
        """A step applied and then deliberately undone by a later one (decided by
        `decide.undone_on_purpose`): done, with no object to adopt — they are gone."""
        self.events.step_started(step, Action.UNDONE.value)
        self.transition(step, "done")
        result.adopted.append(step.id)
        self.events.step_finished(step, "adopted", 0.0)

    def execute(self, step: Step, row: ledger.StepRow | None, holds: bool | None,
                result: RunResult) -> None:  # fmt: skip
        """Skip, adopt or run one step whose turn it is. `holds`: its postcondition, read
        just now (None when the ledger already says done)."""
        action = action_for(step, row, holds)
        self.events.step_started(step, action.value)
        try:
            self._carry_out(step, action, result)
        except KeyboardInterrupt:  # SIGINT, SIGTERM (cli.signals.Terminated)
            self.interrupted(step)
            raise

    def interrupted(self, step: Step, *, undoing: bool = False) -> None:
        """Report how the interrupted step (or its inverse) ended, as the ledger has it: a
        signal can land after the COMMIT was acknowledged and before the runner's next
        statement, where only the ledger row that committed with the work knows."""
        report = getattr(self.events, "interrupted", None)  # optional (`RunnerEvents`)
        if report is not None:
            report(step, self._outcome(step, undoing))

    def _outcome(self, step: Step, undoing: bool) -> str:
        conn = self.conn
        if (
            self.migration_id is None
            or conn.closed
            or conn.info.transaction_status is not TransactionStatus.IDLE
        ):
            # Busy with a query the interrupt cut short (its ROLLBACK could not be sent), or
            # inside someone else's transaction: this session cannot tell.
            return "unknown"
        try:
            row = conn.execute(
                "SELECT state FROM outbox_migrate.step WHERE migration_id = %s AND step_id = %s",
                (self.migration_id, step.id),
            ).fetchone()
        except psycopg.Error:
            return "unknown"
        state = row[0] if row else None
        if state == ("rolled_back" if undoing else "done"):
            return "committed"
        return "unfinished" if state == "running" else "rolled-back"

    def _carry_out(self, step: Step, action: Action, result: RunResult) -> None:
        started = time.monotonic()
        if action is Action.ALREADY_DONE:
            result.skipped.append(step.id)
            return
        if action is Action.ADOPT:
            # Adopting is the one way a migration takes an object it did not create in this
            # run: only when no live migration owns it (recorded by OID).
            with self.conn.transaction():
                migration_id = self._recording()
                origin = ownership.check_adoptable(self.conn, migration_id, step, self.spec)
                ownership.record(self.conn, migration_id, step, self.spec, origin)
                self.transition(step, "done")
            result.adopted.append(step.id)
            self.events.step_finished(step, "adopted", time.monotonic() - started)
            return
        self._run(step)
        fault(step.id, "after-commit")
        result.ran.append(step.id)
        self.events.step_finished(step, "done", time.monotonic() - started)

    def _run(self, step: Step) -> None:
        self._started_at = datetime.now(UTC)
        try:
            check_conditions(self.conn, step.id, before_transaction(step))
            self._preflight(step)
            fault(step.id, "before")
            waited_ms = executor_for(step).apply(self, step)
        except PreconditionFailed as exc:
            exc = self._name_taken(exc)
            self._record_refusal(step, str(exc))
            raise exc from None
        except StepFailed:
            raise
        except psycopg.Error as exc:
            if connection_lost(exc, self.conn):
                raise ConnectionLost(
                    f"step {step.id}", one_line(str(exc), self.options.dsn)
                ) from None
            message = one_line(str(exc), self.options.dsn)
            if isinstance(exc, errors.QueryCanceled) and step.catalog_only:
                message += (
                    f" (statement_timeout {step.statement_timeout_ms} ms: the step was "
                    "expected to be catalog-only; a table scan was stopped)"
                )
            self.transition(step, "failed", error=message)
            raise StepFailed(step.id, message) from None
        except Exception as exc:  # the lock budget, long transactions, a job's own error
            if not self.conn.closed:
                self.transition(step, "failed", error=str(exc))
            raise
        if waited_ms:
            ledger.record_lock_wait(self.conn, self._recording(), step.id, waited_ms)

    def _name_taken(self, refused: PreconditionFailed) -> PreconditionFailed:
        """A relation this migration would create exists already and is not its own (its
        step would have been adopted): say whose it is and that the way out is a name of this
        migration's own, not "reset the ledger", which would not free the name."""
        base, _, relation = refused.condition.partition(":")
        options = {
            self.spec.partitioned_table: "--partitioned-table",
            self.spec.unpublished_partition: "--unpublished-partition",
            self.spec.published_partition: "--published-partition",
        }
        if base != "relation-absent" or relation not in options:
            return refused
        owner = ownership.relation_owner(self.conn, self.spec, relation)
        whose = (
            f"{owner.pattern.upper()} migration #{owner.migration_id} of "
            f"{owner.table} ({owner.state}) created it"
            if owner is not None
            else "no migration recorded here created it"
        )
        return PreconditionFailed(
            refused.step_id,
            refused.condition,
            f"{self.spec.schema}.{relation} already exists and is not this migration's "
            f"({whose}): give this migration a name of its own with {options[relation]} NAME, "
            "or drop the relation if it is a leftover nobody uses",
        )

    def _record_refusal(self, step: Step, message: str) -> None:
        """A step refused at run time stays pending (it did nothing), with the reason for
        `status`. The command was admitted; this is what its step found when its turn came."""
        if self.conn.closed:
            return
        if self.conn.info.transaction_status is TransactionStatus.INERROR:
            return  # inside a borrowed (Alembic) transaction that is aborting anyway
        self.transition(step, "pending", error=message)

    def _preflight(self, step: Step) -> None:
        """Before ACCESS EXCLUSIVE: report (or refuse on) long or idle-in-transaction
        sessions holding locks on the step's relations — our queued request would make every
        writer wait behind them."""
        if step.strongest_lock is not LockMode.ACCESS_EXCLUSIVE:
            return
        relations = [lock.relation for lock in step.locks]
        longs = long_transactions(self.conn, relations, self.spec.schema)
        if not longs:
            return
        if self.options.on_long_tx == "refuse":
            raise LongTransactionsPresent(step.id, longs)
        for blocker in longs:
            if blocker.hidden_from:
                self.events.warning(
                    step, "cannot see whether a session holding a lock it needs is a long "
                    f"transaction: {blocker.describe()}; trying under lock_timeout",
                )  # fmt: skip
                continue
            self.events.warning(
                step, f"long transaction holds a lock it needs: {blocker.describe()}; "
                "waiting for it to end without queueing (writers are not stalled meanwhile)",
            )  # fmt: skip

    # -- the shape of every transaction -----------------------------------------------------

    def budget(self, step: Step | None = None) -> LockBudget:
        settings = self.options.settings
        return LockBudget(
            lock_timeout_ms=settings.lock_timeout_ms,
            budget_s=settings.lock_budget_s,
            statement_timeout_ms=step.statement_timeout_ms if step is not None else None,
        )

    def in_step_transaction(
        self,
        step: Step,
        label: str,
        budget: LockBudget,
        body: Callable[[psycopg.Connection[Any]], None],
        on_attempt: Callable[[AttemptLog], None] | None = None,
    ) -> float:
        """The shape of every transactional step and inverse: take the declared locks, then
        `body` (its checks and its work), all in one transaction, retried under the budget."""

        def locked_body(conn: psycopg.Connection[Any]) -> None:
            lock_declared(
                conn,
                [(lock.relation, lock.mode) for lock in step.locks],
                self.spec.schema,
                self.spec.partitioned_table,
            )
            body(conn)

        return run_with_lock_budget(
            self.conn,
            label,
            budget,
            locked_body,
            relations=[(lock.relation, lock.mode) for lock in step.locks],
            schema=self.spec.schema,
            on_attempt=on_attempt,
            watch_blockers=self.options.watch_blockers,
        )

    def read_under_budget(
        self, label: str, relations: list[str], body: Callable[[psycopg.Connection[Any]], None]
    ) -> None:
        """Reads that wait for nobody: under the lock budget like a step, so a session
        holding ACCESS EXCLUSIVE on a table is watched and named, never queued behind."""
        run_with_lock_budget(
            self.conn, label, self.budget(), body,
            relations=[(relation, LockMode.ACCESS_SHARE) for relation in relations],
            schema=self.spec.schema, watch_blockers=self.options.watch_blockers,
        )  # fmt: skip

    def _attempt(self, step: Step, log: AttemptLog) -> None:
        ledger.record_attempt(
            self.conn, self._recording(), step.id, log.attempt, log.outcome, log.waited_ms,
            [vars(b) for b in log.blockers],
        )  # fmt: skip
        self.events.attempt(step, log)

    def _recording(self) -> int:
        if self.migration_id is None:
            raise RuntimeError("a step applied outside a migration record")
        return self.migration_id
