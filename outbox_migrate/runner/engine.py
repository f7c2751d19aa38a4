"""The runner: a thin driver over the pure decisions in `decide.py`.

It owns the connection, the session advisory lock ("one runner per table"), the ledger
updates and the lock-safe execution; what to do next is always decided by `decide`. Core code:
it reports through `RunnerEvents` and raises errors, never prints or exits.
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import errors, sql
from psycopg.pq import TransactionStatus

from outbox_migrate.config import Settings
from outbox_migrate.db import connect, one_line
from outbox_migrate.errors import ConnectionLost, SchemaError, UsageError
from outbox_migrate.patterns import BuildOptions, build_pattern
from outbox_migrate.patterns.model import (
    Condition,
    LockMode,
    Pattern,
    PublicationFact,
    Step,
    TxMode,
)
from outbox_migrate.runner import ledger, ownership
from outbox_migrate.runner.admission import admit, ledger_exists
from outbox_migrate.runner.checks import (
    before_transaction,
    check_conditions,
    under_lock,
    violations,
)
from outbox_migrate.runner.decide import (
    Action,
    action_for,
    completed_phase,
    phase_index,
    steps_to_reverse,
    steps_to_run,
)
from outbox_migrate.runner.errors import (
    LockBudgetExceeded,
    LongTransactionsPresent,
    OutOfOrder,
    PreconditionFailed,
    RunnerBusy,
    StepFailed,
    VerifyFailed,
)
from outbox_migrate.runner.events import RunnerEvents, SilentEvents
from outbox_migrate.runner.executors import executor_for
from outbox_migrate.runner.locks import (
    AttemptLog,
    LockBudget,
    lock_declared,
    long_transactions,
    run_with_lock_budget,
)

RUNNER_LOCK_CLASS = 0x6F6D7275  # "omru": first key of the per-table session advisory lock
FAULT_ENV = "OUTBOX_MIGRATE_FAULT"
"""Test hook: `<step-id>@<point>` SIGKILLs the runner at that point (before, after-ddl,
after-commit) so crash recovery can be tested at every instant. Unset in production."""


def _fault(step_id: str, point: str) -> None:
    wanted = os.environ.get(FAULT_ENV)
    if wanted and wanted == f"{step_id}@{point}":
        os.kill(os.getpid(), signal.SIGKILL)


CONNECTION_SQLSTATES = ("08", "57P01", "57P02", "57P03")
"""Connection exceptions and server shutdowns: the session is gone, not the statement."""


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


class Runner:
    """One migration (table, pattern) driven step by step. Use as a context manager."""

    def __init__(
        self,
        dsn: str,
        settings: Settings,
        pattern: str,
        *,
        include_optional: bool = False,
        events: RunnerEvents | None = None,
        on_long_tx: str = "wait",
        copy_back_options: Any = None,
    ) -> None:
        if on_long_tx not in ("wait", "refuse"):
            raise ValueError("on_long_tx must be 'wait' or 'refuse'")
        self.dsn = dsn
        self.settings = settings
        self.spec = settings.spec
        self._pattern_name = pattern
        self._include_optional = include_optional
        self.pattern: Pattern = build_pattern(
            pattern,
            settings.spec,
            BuildOptions(
                sample_window_s=settings.gate_window_s,
                old_app_name=settings.old_app_name,
                include_optional=include_optional,
            ),
        )
        self._publications: tuple[PublicationFact, ...] = ()
        self.events: RunnerEvents = events or SilentEvents()
        self.on_long_tx = on_long_tx
        self.copy_back_options = copy_back_options
        self._conn: psycopg.Connection[Any] | None = None
        self._locked = False
        self._borrowed = False
        self.job_dsn: str | None = dsn
        self.step_started_at: datetime | None = None
        self.watch_blockers = True
        """Watch a known conflicting lock holder instead of queueing behind it (False only to
        measure the 0.1 behaviour in bench/lock_wait.py)."""

    @classmethod
    def attached(
        cls,
        conn: psycopg.Connection[Any],
        settings: Settings,
        pattern: str,
        *,
        include_optional: bool = False,
        events: RunnerEvents | None = None,
    ) -> Runner:
        """A runner driving `conn`, a connection someone else owns (Alembic's).

        On an autocommit connection every step gets its own transaction, as with `run`; on a
        connection inside a transaction the step's work joins it (lock-budget attempts become
        savepoints) and commits when its owner commits. Leaving the `with` block releases the
        advisory lock instead of closing the connection. The ledger schema must exist
        (`ledger.ensure_schema`, run outside the transaction being joined so its setup lock
        is not held for the whole step).
        """
        runner = cls("", settings, pattern, include_optional=include_optional, events=events)
        runner._conn = conn
        runner._borrowed = True
        runner.job_dsn = None  # the copy-back job's adaptive throttle needs its own DSN
        return runner

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Runner:
        if not self._borrowed:
            # The ledger schema is created by the first command that writes to it, after the
            # admission check (`_open`): refused input leaves the database exactly as it was.
            self._conn = connect(self.dsn)
        self._adopt_publications()
        return self

    def _adopt_publications(self) -> None:
        """Every command (run, status, reverse, Alembic's ops) sees the same steps: the CDC
        step exists only when a publication covers the old table, which only the live
        database knows."""
        from outbox_migrate.introspect import migration_publications
        from outbox_migrate.runner.recorded_optional import optional_recorded

        publications = migration_publications(self.conn, self.spec)
        recorded = not self._include_optional and optional_recorded(
            self.conn, self.spec, self._pattern_name
        )
        self._include_optional = self._include_optional or recorded
        if publications or recorded:
            self._publications = publications
            self.pattern = build_pattern(
                self._pattern_name,
                self.spec,
                BuildOptions(
                    sample_window_s=self.settings.gate_window_s,
                    old_app_name=self.settings.old_app_name,
                    include_optional=self._include_optional,
                    publications=publications,
                ),
            )

    def __exit__(self, *exc: object) -> None:
        if self._borrowed:
            self.release()
            self._conn = None
            return
        if self._conn is not None:
            self._conn.close()  # closing the session releases the advisory lock
            self._conn = None

    def release(self) -> None:
        """Give the per-table advisory lock back without closing the session."""
        conn = self._conn
        # In a failed transaction the unlock cannot run; raising here would hide the step's
        # own error, and the end of the owner's session releases the lock anyway.
        if (
            self._locked
            and conn is not None
            and not conn.closed
            and conn.info.transaction_status is not TransactionStatus.INERROR
        ):
            first, second = self._lock_key()
            conn.execute("SELECT pg_advisory_unlock(%s, %s)", (first, second))
        self._locked = False

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None:
            raise RuntimeError("Runner used outside its `with` block")
        return self._conn

    @property
    def table_label(self) -> str:
        return f"{self.spec.schema}.{self.spec.table}"

    def _lock_key(self) -> tuple[int, int]:
        return RUNNER_LOCK_CLASS, zlib.crc32(self.table_label.encode()) & 0x7FFFFFFF

    def acquire(self) -> None:
        """The session advisory lock that admits one runner per table."""
        if self._locked:
            return
        first, second = self._lock_key()
        row = self.conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (first, second)).fetchone()
        if row and row[0]:
            self._locked = True
            return
        holder = self.conn.execute(
            "SELECT a.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), "
            "'local socket'), a.backend_start FROM pg_locks l JOIN pg_stat_activity a "
            "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.classid = %s "
            "AND l.objid = %s AND l.objsubid = 2 AND l.granted",
            (first, second),
        ).fetchone()
        who = (
            f"pid {holder[0]} ({holder[1] or 'no application_name'}, from {holder[2]}, "
            f"connected since {holder[3]:%Y-%m-%d %H:%M:%S})"
            if holder
            else "a session that just ended; retry"
        )
        raise RunnerBusy(self.table_label, who)

    # -- queries ----------------------------------------------------------------------------

    def _violations(self, conditions: tuple[Condition, ...] | list[Condition]) -> list[str]:
        return violations(self.conn, conditions)

    def _check(self, step: Step, conditions: tuple[Condition, ...], label: str = "") -> None:
        check_conditions(self.conn, label or step.id, conditions)

    def _identity_generation(self) -> str:
        """ALWAYS or BY DEFAULT: how the old table's id was generated, so that reversing DROP
        IDENTITY restores the same kind. Read live while the identity exists, afterwards from
        what the ledger recorded when the migration started."""
        row = self.conn.execute(
            "SELECT a.attidentity FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
            "WHERE a.attrelid = to_regclass(%s) AND a.attname = %s AND NOT c.relispartition",
            (sql.Identifier(self.spec.schema, self.spec.table).as_string(None),
             self.spec.id_column),
        ).fetchone()  # fmt: skip
        if row and row[0] in ("a", "d"):
            return "ALWAYS" if row[0] == "a" else "BY DEFAULT"
        return ledger.recorded_identity_generation(self.conn, self.spec) or "ALWAYS"

    def _adopt_identity_generation(self) -> str:
        """Rebuild the pattern from what the live database says: the old id's generation and
        the publications covering the old table (CDC users' conditional step)."""
        from outbox_migrate.introspect import migration_publications

        generation = self._identity_generation()
        publications = migration_publications(self.conn, self.spec)
        self._publications = publications
        if generation != "ALWAYS" or publications:
            self.pattern = build_pattern(
                self._pattern_name,
                self.spec,
                BuildOptions(
                    sample_window_s=self.settings.gate_window_s,
                    old_app_name=self.settings.old_app_name,
                    include_optional=self._include_optional,
                    identity_generation=generation,
                    publications=publications,
                ),
            )
        return generation

    def _existing_rows(self) -> dict[str, ledger.StepRow]:
        """The ledger rows of this table's migration with this pattern, read-only (empty when
        there is none, or no ledger at all yet)."""
        migration = self._latest()
        return self._rows(migration) if migration is not None else {}

    def _open(self, to_phase: str | None = None) -> ledger.MigrationRow:
        """Admit, then find or start the migration record. Everything that can refuse — a
        wrong --table, a blocker `plan` reports, another pattern's migration, a phase out of
        order — refuses before the ledger is written (one line, exit 2, like `plan`)."""
        found = self.conn.execute(
            "SELECT to_regclass(%s)",
            (sql.Identifier(self.spec.schema, self.spec.table).as_string(None),),
        ).fetchone()
        if found is None or found[0] is None:
            raise SchemaError(
                f"table {self.table_label} does not exist in database "
                f"{self.conn.info.dbname!r}; check --schema/--table (outbox-migrate config)"
            )
        # The admission reads the table (introspection); under the lock budget like a step,
        # so a session holding ACCESS EXCLUSIVE on it is named instead of waited on for ever.
        run_with_lock_budget(
            self.conn, f"{self.pattern.name} admission",
            LockBudget(self.settings.lock_timeout_ms, self.settings.lock_budget_s, None),
            lambda conn: admit(conn, self.spec, self.pattern.name),
            relations=[(self.spec.table, LockMode.ACCESS_SHARE)], schema=self.spec.schema,
            watch_blockers=self.watch_blockers,
        )  # fmt: skip
        if to_phase is not None:
            steps_to_run(self.pattern, self._existing_rows(), to_phase)
        if not self._borrowed:
            ledger.ensure_schema(self.conn)
        generation = self._adopt_identity_generation()
        migration = ledger.open_migration(
            self.conn,
            self.pattern,
            self.spec,
            {
                "identity_generation": generation,
                "publications": ledger.publications_json(self._publications),
            },
        )
        ledger.sync_steps(self.conn, migration, self.pattern)
        return migration

    def _rows(self, migration: ledger.MigrationRow) -> dict[str, ledger.StepRow]:
        return {row.step_id: row for row in ledger.steps(self.conn, migration.id)}

    # -- commands ---------------------------------------------------------------------------

    def run(self, to_phase: str) -> RunResult:
        """Run every pending step through the end of `to_phase`, then stop at that boundary."""
        self.acquire()
        migration = self._open(to_phase)
        rows = self._rows(migration)
        pending = steps_to_run(self.pattern, rows, to_phase)
        result = RunResult(self.pattern.name, to_phase)
        for step in pending:
            self._execute(migration, step, rows.get(step.id), result)
        return self._finish(migration, result, to_phase)

    def next(self) -> RunResult:
        """Run exactly one step: the first pending one, if it is in the next phase at most."""
        self.acquire()
        migration = self._open()
        rows = self._rows(migration)
        done = phase_index(self.pattern, completed_phase(self.pattern, rows))
        target = self.pattern.phases[min(done + 1, len(self.pattern.phases) - 1)].name
        pending = steps_to_run(self.pattern, rows, target)
        result = RunResult(self.pattern.name, target)
        target = completed_phase(self.pattern, rows)
        if pending:
            self._execute(migration, pending[0], rows.get(pending[0].id), result)
            target = pending[0].phase
        return self._finish(migration, result, target)

    def step(self, step_id: str) -> Step:
        """The pattern's step called `step_id` (a `UsageError` names the known ones)."""
        for step in self.pattern.steps():
            if step.id == step_id:
                return step
        raise UsageError(
            f"pattern {self.pattern.acronym} has no step {step_id!r}; its steps are "
            + ", ".join(s.id for s in self.pattern.steps())
        )

    def execute_step(self, step_id: str) -> RunResult:
        """Run one named step as `run` would: same deploy-boundary rule, preconditions, lock
        budget, ledger. Every earlier step must be done; one done outside the ledger (offline
        SQL) is adopted when its postcondition holds (or a later step deliberately undid it),
        and an earlier deploy gate is checked again."""
        step = self.step(step_id)
        self.acquire()
        migration = self._open()
        rows = self._rows(migration)
        result = RunResult(self.pattern.name, step.phase)
        if step.id in rows and rows[step.id].state == "done":
            result.skipped.append(step.id)
            return self._finish(migration, result, step.phase)
        steps = self.pattern.steps()
        before = steps[: steps.index(step)]
        for index, earlier in enumerate(before):
            row = rows.get(earlier.id)
            if row is not None and row.state == "done":
                continue
            undoers = [later for later in before[index + 1 :] if later.kind in earlier.undone_by]
            if any(self._done_or_proven(later, rows) for later in undoers):
                # Its effect is gone on purpose: a later step that undoes it is done (in the
                # ledger, or proven by its postcondition — offline SQL). Never on the mere
                # presence of that step in the pattern: a step not yet applied undoes nothing.
                ledger.mark(self.conn, migration.id, earlier.id, "done")
                result.adopted.append(earlier.id)
                continue
            proven = bool(earlier.postcondition) and not self._violations(earlier.postcondition)
            if not proven and earlier.tx is not TxMode.NONE:
                raise OutOfOrder(
                    f"{step.id} needs {earlier.id} first, and it is not done "
                    "(apply the revisions in order)"
                )
            self._execute(migration, earlier, row, result)
        rows = self._rows(migration)
        steps_to_run(self.pattern, rows, step.phase)  # the deploy-boundary rule of `run`
        self._execute(migration, step, rows.get(step.id), result)
        return self._finish(migration, result, step.phase)

    def _done_or_proven(self, step: Step, rows: dict[str, ledger.StepRow]) -> bool:
        row = rows.get(step.id)
        if row is not None and row.state == "done":
            return True
        return bool(step.postcondition) and not self._violations(step.postcondition)

    def reverse_step(self, step_id: str) -> bool:
        """Undo one step (its `reverse`), newest first like `rollback`. False when it was
        never applied (nothing to undo); `OutOfOrder` when it cannot be reversed."""
        from outbox_migrate.runner.reverse import reverse_one

        return reverse_one(self, step_id)

    def _finish(self, migration: ledger.MigrationRow, result: RunResult, target: str) -> RunResult:
        rows = self._rows(migration)
        # A phase without steps (COPRA's V4) is complete at once, but the runner only reports
        # reaching the phase the operator asked for: the deploy boundary stays explicit.
        reached_index = min(
            phase_index(self.pattern, completed_phase(self.pattern, rows)),
            phase_index(self.pattern, target),
        )
        reached = self.pattern.phases[reached_index].name
        # Optional phases (the original name) may follow a completed migration.
        last = phase_index(self.pattern, self.pattern.last_required_phase())
        result.completed = reached_index >= last
        result.phase = reached
        ledger.set_phase(
            self.conn, migration.id, reached, "completed" if result.completed else "active"
        )
        return result

    def _execute(
        self, migration: ledger.MigrationRow, step: Step, row: ledger.StepRow | None,
        result: RunResult,
    ) -> None:  # fmt: skip
        executor = executor_for(step)
        holds: bool | None = None  # the ledger's "done" needs no catalog query
        if step.postcondition and (row is None or row.state != "done"):
            holds = executor.proven(self, step)
        action = action_for(step, row, holds)
        self.events.step_started(step, action.value)
        started = time.monotonic()
        if action is Action.ALREADY_DONE:
            result.skipped.append(step.id)
            return
        if action is Action.ADOPT:
            # Adopting is the one way a migration takes an object it did not create in this
            # run: only when no live migration owns it (recorded by OID).
            with self.conn.transaction():
                origin = ownership.check_adoptable(self.conn, migration.id, step, self.spec)
                ownership.record(self.conn, migration.id, step, self.spec, origin)
                ledger.mark(self.conn, migration.id, step.id, "done")
            result.adopted.append(step.id)
            self.events.step_finished(step, "adopted", time.monotonic() - started)
            return
        self.step_started_at = datetime.now(UTC)
        try:
            self._check(step, before_transaction(step))
            self._preflight(step)
            _fault(step.id, "before")
            waited_ms = executor.apply(self, migration, step)
        except PreconditionFailed as exc:
            self._record_refusal(migration, step, str(exc))
            raise
        except StepFailed:
            raise
        except (LockBudgetExceeded, LongTransactionsPresent) as exc:
            ledger.mark(self.conn, migration.id, step.id, "failed", error=str(exc)[:500])
            raise
        except psycopg.Error as exc:
            if connection_lost(exc, self._conn):
                raise ConnectionLost(f"step {step.id}", one_line(str(exc), self.dsn)) from None
            message = one_line(str(exc), self.dsn)
            if isinstance(exc, errors.QueryCanceled) and step.catalog_only:
                message += (
                    f" (statement_timeout {step.statement_timeout_ms} ms: the step was "
                    "expected to be catalog-only; a table scan was stopped)"
                )
            ledger.mark(self.conn, migration.id, step.id, "failed", error=message)
            raise StepFailed(step.id, message) from None
        except Exception as exc:
            if self._conn is not None and not self._conn.closed:
                ledger.mark(self.conn, migration.id, step.id, "failed", error=str(exc)[:500])
            raise
        _fault(step.id, "after-commit")
        result.ran.append(step.id)
        if waited_ms:
            self.conn.execute(
                "UPDATE outbox_migrate.step SET lock_wait_ms = %s "
                "WHERE migration_id = %s AND step_id = %s",
                (waited_ms, migration.id, step.id),
            )
        self.events.step_finished(step, "done", time.monotonic() - started)

    def _record_refusal(self, migration: ledger.MigrationRow, step: Step, message: str) -> None:
        """A refused step stays pending (it did nothing), with the reason for `status`."""
        if self._conn is None or self._conn.closed:
            return
        from psycopg.pq import TransactionStatus

        if self.conn.info.transaction_status is TransactionStatus.INERROR:
            return  # inside a borrowed (Alembic) transaction that is aborting anyway
        ledger.mark(self.conn, migration.id, step.id, "pending", error=message[:500])

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
        if self.on_long_tx == "refuse":
            raise LongTransactionsPresent(step.id, longs)
        for blocker in longs:
            self.events.warning(
                step, f"long transaction holds a lock it needs: {blocker.describe()}; "
                "waiting for it to end without queueing (writers are not stalled meanwhile)",
            )  # fmt: skip

    def _budget(self, step: Step) -> LockBudget:
        return LockBudget(
            lock_timeout_ms=self.settings.lock_timeout_ms,
            budget_s=self.settings.lock_budget_s,
            statement_timeout_ms=step.statement_timeout_ms,
        )

    def in_step_transaction(
        self,
        step: Step,
        label: str,
        budget: LockBudget,
        body: Any,
        on_attempt: Any = None,
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
            watch_blockers=self.watch_blockers,
        )

    def apply_in_transaction(self, migration: ledger.MigrationRow, step: Step) -> float:
        """Locks, then the checks that must hold at commit, then the DDL, the ledger row and
        the ownership records — one transaction; milliseconds lost waiting for locks."""

        def body(conn: psycopg.Connection[Any]) -> None:
            check_conditions(conn, step.id, under_lock(step))
            for statement in step.statements:
                conn.execute(statement)
            # The locks were taken first, so the order of these last writes does not
            # lengthen any lock hold; the ledger row commits with the DDL.
            ledger.mark(conn, migration.id, step.id, "done", started_at=self.step_started_at)
            ownership.record(conn, migration.id, step, self.spec, "created")
            _fault(step.id, "after-ddl")

        return self.in_step_transaction(
            step, step.id, self._budget(step), body,
            on_attempt=lambda log: self._attempt(migration, step, log),
        )  # fmt: skip

    def apply_autocommit(self, migration: ledger.MigrationRow, step: Step) -> float:
        """Statements that refuse a transaction block: run, then re-prove at the end — the
        postcondition, and every LOCKED precondition again — before recording done."""
        ledger.mark(self.conn, migration.id, step.id, "running", started=True)
        self.conn.execute(
            sql.SQL("SET lock_timeout = {}").format(
                sql.Literal(f"{self.settings.lock_timeout_ms}ms")
            )
        )
        try:
            for statement in step.statements:
                self.conn.execute(statement)
        finally:
            self.conn.execute("RESET lock_timeout")
        self.prove_done(migration, step)
        return 0.0

    def prove_done(self, migration: ledger.MigrationRow, step: Step) -> None:
        problems = self._violations(step.postcondition)
        if problems:
            raise StepFailed(step.id, f"finished but not proven done: {problems[0]}")
        with self.conn.transaction():
            ownership.record(self.conn, migration.id, step, self.spec, "created")
            ledger.mark(self.conn, migration.id, step.id, "done")

    def _attempt(self, migration: ledger.MigrationRow, step: Step, log: AttemptLog) -> None:
        ledger.record_attempt(
            self.conn, migration.id, step.id, log.attempt, log.outcome, log.waited_ms,
            [vars(b) for b in log.blockers],
        )  # fmt: skip
        self.events.attempt(step, log)

    # -- status, verify, rollback, reset -------------------------------------------------------

    def _latest(self) -> ledger.MigrationRow | None:
        """This table's migration with this pattern; None before any ledger exists (reading
        never creates the ledger)."""
        if not ledger_exists(self.conn):
            return None
        return ledger.latest(self.conn, self.spec, self.pattern.name)

    def status(self) -> dict[str, Any]:
        migration = self._latest()
        if migration is None:
            return {"table": self.table_label, "pattern": self.pattern.name, "state": "not started",
                    "phase": self.pattern.phases[0].name, "steps": []}  # fmt: skip
        rows = self._rows(migration)
        reached = self._current_phase(migration, rows)
        index = phase_index(self.pattern, reached)
        following = (
            self.pattern.phases[index + 1].name if index + 1 < len(self.pattern.phases) else None
        )
        return {
            "table": self.table_label,
            "pattern": self.pattern.name,
            "state": migration.state,
            "phase": reached,
            "next_phase": following,
            "steps": [
                {
                    "id": step.id,
                    "phase": step.phase,
                    "summary": step.summary,
                    **(rows[step.id].to_json() if step.id in rows else {"state": "pending"}),
                }
                for step in self.pattern.steps()
            ],
        }

    def _current_phase(
        self, migration: ledger.MigrationRow, rows: dict[str, ledger.StepRow]
    ) -> str:
        """The phase the ledger records as reached, never beyond what its steps prove."""
        proven = phase_index(self.pattern, completed_phase(self.pattern, rows))
        try:
            recorded = phase_index(self.pattern, migration.current_phase)
        except OutOfOrder:
            recorded = proven
        return self.pattern.phases[min(proven, recorded)].name

    def current_phase(self) -> str:
        migration = self._latest()
        if migration is None:
            return self.pattern.phases[0].name
        return self._current_phase(migration, self._rows(migration))

    def verify(self) -> list[str]:
        """Violations of the current phase's invariants (empty: all hold)."""
        phase = self.current_phase()
        migration = self._latest()
        rows = self._rows(migration) if migration is not None else {}
        done = frozenset(i for i, row in rows.items() if row.state == "done")
        return self._violations([c for _, c in self.pattern.invariants(phase, done)])

    def verify_or_raise(self) -> str:
        phase = self.current_phase()
        problems = self.verify()
        if problems:
            raise VerifyFailed(phase, problems)
        return phase

    def rollback(self, to_phase: str) -> list[str]:
        """Undo, newest first, every done step after `to_phase` (see `reverse.rollback`)."""
        from outbox_migrate.runner.reverse import rollback

        return rollback(self, to_phase)

    def reset(self, *, force: bool = False) -> bool:
        """Abandon the table's active migration record (schema objects are left as they are).

        Refused while steps of it are applied, unless `force`: the record is the only thing
        that knows how to undo them. Abandoning a COPRA migration after its `drop-identity`
        left the old table with no id default — V1's inserts failed and no pattern could
        start again (found by the operator fuzzer). `rollback --to V1` first undoes what can
        be undone; then the record can go.
        """
        self.acquire()
        if not ledger_exists(self.conn):
            return False
        active = ledger.active_for_table(self.conn, self.spec)
        if active is None:
            return False
        if not force:
            if active.pattern != self.pattern.name:
                raise OutOfOrder(
                    f"the active migration of {self.table_label} is a "
                    f"{active.pattern.upper()} one: reset --pattern {active.pattern}"
                )
            applied = steps_to_reverse(
                self.pattern, self._rows(active), self.pattern.phases[0].name
            )
            if applied:
                first = self.pattern.phases[0].name
                raise PreconditionFailed(
                    "reset",
                    "nothing-applied",
                    f"{len(applied)} step(s) of this migration are applied (latest "
                    f"{applied[0].id}) and only its record can undo them: run `outbox-migrate "
                    f"rollback --pattern {self.pattern.name} --to {first}` first, or `reset "
                    "--force` to abandon it with the schema as it is",
                )
        ledger.abandon(self.conn, active.id)
        return True
