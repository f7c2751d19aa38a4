"""The `Runner`: a thin façade that wires the runner's parts together for one command,
plan → validate → apply. It reports through `RunnerEvents`; it never prints or exits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import psycopg

from outbox_migrate.config import Settings
from outbox_migrate.errors import OutOfOrder
from outbox_migrate.patterns import build_from_settings
from outbox_migrate.patterns.model import Pattern, Step
from outbox_migrate.runner import ledger, ownership
from outbox_migrate.runner.admission import admit, require_table
from outbox_migrate.runner.apply import (
    FAULT_ENV,
    RunResult,
    StepApplier,
    connection_lost,
)
from outbox_migrate.runner.decide import (
    Action,
    check_definitions,
    check_reset,
    completed_phase,
    irreversible,
    phase_index,
    plan_execute_step,
    reached_phase,
    step_named,
    steps_to_run,
)
from outbox_migrate.runner.events import RunnerEvents, SilentEvents
from outbox_migrate.runner.facts import LiveFacts
from outbox_migrate.runner.inspect import recorded_document, unrecorded_document
from outbox_migrate.runner.reverse import reverse_one
from outbox_migrate.runner.reverse import rollback as rollback_to
from outbox_migrate.runner.session import RUNNER_LOCK_CLASS, Session

__all__ = ["FAULT_ENV", "RUNNER_LOCK_CLASS", "RunResult", "Runner", "connection_lost"]


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
        self.pattern: Pattern = build_from_settings(
            pattern, settings, include_optional=include_optional
        )
        """Offline (names, phases, `--help`) until the `with` block reads the live one."""
        self.events: RunnerEvents = events or SilentEvents()
        self.on_long_tx = on_long_tx
        self.copy_back_options = copy_back_options
        self.session = Session(dsn, self.table_label)
        self.job_dsn: str | None = dsn
        self.watch_blockers = True
        """Watch a known conflicting lock holder instead of queueing behind it (False only to
        measure the 0.1 behaviour in bench/lock_wait.py)."""
        self._facts: LiveFacts | None = None

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
        runner.session.borrow(conn)
        runner.job_dsn = None  # the copy-back job's adaptive throttle needs its own DSN
        return runner

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Runner:
        # The ledger schema is created by the first command that writes to it, after the
        # command is admitted: refused input leaves the database exactly as it was.
        self.session.open()
        try:
            self._read_facts()
        except BaseException:
            # `with` calls no __exit__ when __enter__ raises: a refused marker or a lost
            # connection while reading the facts must not leave the session open.
            self.session.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.close()
        self._facts = None

    def acquire(self) -> None:
        self.session.acquire()

    @property
    def conn(self) -> psycopg.Connection[Any]:
        return self.session.conn

    @property
    def table_label(self) -> str:
        return f"{self.spec.schema}.{self.spec.table}"

    def _read_facts(self) -> LiveFacts:
        """The live facts, read once when the `with` block opens: the identity kind and the
        publications are recorded when the migration starts, so they do not change under
        it; what holds is asked on demand."""
        self._facts = LiveFacts(self.conn, self.settings, self._pattern_name,
                                self._include_optional)  # fmt: skip
        self.pattern = self._facts.pattern
        return self._facts

    def _applier(self, migration_id: int | None) -> StepApplier:
        return StepApplier(self.conn, self, migration_id)

    # -- plan → validate → record ------------------------------------------------------------

    def _admit(self) -> dict[str, ledger.StepRow]:
        """Everything that can refuse a command before it writes: a wrong --table, a blocker
        `plan` reports, another pattern's migration, a step whose definition changed. Returns
        this migration's ledger rows, read-only (empty when there are none yet)."""
        require_table(self.conn, self.spec)
        # The admission reads the table (introspection); under the lock budget like a step,
        # so a session holding ACCESS EXCLUSIVE on it is named instead of waited on for ever.
        self._applier(None).read_under_budget(
            f"{self.pattern.name} admission", [self.spec.table],
            lambda conn: admit(conn, self.spec, self.pattern.name),
        )  # fmt: skip
        facts = self._facts_now()
        rows = self._existing_rows()
        check_definitions(facts.pattern, {i: (r.state, r.checksum) for i, r in rows.items()})
        return rows

    def _record(self) -> ledger.MigrationRow:
        """The command is admitted: find or start the migration record, list its steps."""
        if not self.session.borrowed:
            ledger.ensure_schema(self.conn)
        facts = self._facts_now()
        migration = ledger.open_migration(
            self.conn,
            self.pattern,
            self.spec,
            {
                "identity_generation": facts.identity_generation,
                "publications": [asdict(p) for p in facts.publications],
            },
        )
        ledger.sync_steps(self.conn, migration, self.pattern)
        return migration

    @contextmanager
    def _recorded(self) -> Iterator[ledger.MigrationRow]:
        """`_record` for a command that goes on to apply steps. A migration record this
        command started is removed again when the command fails with none of its steps
        applied (each still `pending`: refused at its turn, interrupted before it began): a
        refused command writes nothing, and an `active` migration nothing was done for would
        stand in another pattern's way. The per-table runner lock, held since before the
        record was written, keeps any other runner from seeing it meanwhile."""
        new = self._latest() is None
        migration = self._record()
        try:
            yield migration
        except BaseException:
            if new and not self.session.borrowed and self.session.live:
                with contextlib.suppress(psycopg.Error):  # the command's own error comes first
                    ledger.discard_if_untouched(self.conn, migration.id)
            raise

    def _latest(self) -> ledger.MigrationRow | None:
        """This table's migration with this pattern; None before any ledger exists (reading
        never creates the ledger)."""
        if not ledger.ledger_exists(self.conn):
            return None
        return ledger.latest(self.conn, self.spec, self.pattern.name)

    def _existing_rows(self) -> dict[str, ledger.StepRow]:
        migration = self._latest()
        return self._rows(migration) if migration is not None else {}

    def _rows(self, migration: ledger.MigrationRow) -> dict[str, ledger.StepRow]:
        return ledger.step_rows(self.conn, migration.id)

    def _execute(
        self, applier: StepApplier, step: Step, rows: dict[str, ledger.StepRow], result: RunResult
    ) -> None:
        """Skip, adopt or run `step`, its postcondition read just before its turn."""
        holds = self._facts_now().holding([step], rows).get(step.id)
        applier.execute(step, rows.get(step.id), holds, result)

    def _facts_now(self) -> LiveFacts:
        return self._facts or self._read_facts()

    # -- commands ---------------------------------------------------------------------------

    def run(self, to_phase: str) -> RunResult:
        """Run every pending step through the end of `to_phase`, then stop at that boundary."""
        self.acquire()
        steps_to_run(self.pattern, self._admit(), to_phase)  # decided before anything is written
        with self._recorded() as migration:
            rows = self._rows(migration)
            pending = steps_to_run(self.pattern, rows, to_phase)
            applier = self._applier(migration.id)
            result = RunResult(self.pattern.name, to_phase)
            for step in pending:
                self._execute(applier, step, rows, result)
            return self._finish(migration, result, to_phase)

    def next(self) -> RunResult:
        """Run exactly one step: the first pending one, if it is in the next phase at most."""
        self.acquire()
        self._admit()
        with self._recorded() as migration:
            rows = self._rows(migration)
            done = phase_index(self.pattern, completed_phase(self.pattern, rows))
            target = self.pattern.phases[min(done + 1, len(self.pattern.phases) - 1)].name
            pending = steps_to_run(self.pattern, rows, target)
            result = RunResult(self.pattern.name, target)
            target = completed_phase(self.pattern, rows)
            if pending:
                step = pending[0]
                self._execute(self._applier(migration.id), step, rows, result)
                target = step.phase
            return self._finish(migration, result, target)

    def step(self, step_id: str) -> Step:
        return step_named(self.pattern, step_id)

    def execute_step(self, step_id: str) -> RunResult:
        """Run one named step as `run` would (deploy-boundary rule, preconditions, lock budget,
        ledger), decided in full by `decide.plan_execute_step` before anything is written."""
        self.step(step_id)  # an unknown step is refused before the lock is taken
        self.acquire()
        rows = self._admit()
        facts = self._facts_now()
        step = self.step(step_id)  # as the live pattern has it
        steps = self.pattern.steps()
        holds = facts.holding(steps[: steps.index(step)], rows)
        plan = plan_execute_step(self.pattern, rows, step.id, holds)
        self._check_adoptions([s for s, action in plan.actions if action is Action.ADOPT])
        with self._recorded() as migration:
            rows = self._rows(migration)
            applier = self._applier(migration.id)
            result = RunResult(self.pattern.name, step.phase)
            for planned, action in plan.actions:
                if action is Action.UNDONE:
                    applier.record_undone(planned, result)
                    continue
                self._execute(applier, planned, rows, result)
            return self._finish(migration, result, step.phase)

    def _check_adoptions(self, steps: list[Step]) -> None:
        """Adopting refuses an object another live migration owns: asked (read-only) before
        the plan writes anything, so that refusal too leaves the ledger as it was."""
        if not steps or not ledger.ledger_exists(self.conn):
            return
        latest = self._latest()
        own = latest.id if latest is not None else 0  # 0: no migration id, nothing of ours
        for step in steps:
            ownership.check_adoptable(self.conn, own, step, self.spec)

    def reverse_step(self, step_id: str) -> bool:
        """Undo one step (its `reverse`), newest first like `rollback`. False when it was
        never applied (nothing to undo); `OutOfOrder` when it cannot be reversed."""
        step = self.step(step_id)
        if step.reverse is None:
            raise irreversible(step)
        self.acquire()
        migration = self._latest()
        rows = self._rows(migration) if migration is not None else {}
        applier = self._applier(migration.id if migration is not None else None)
        return reverse_one(applier, self.pattern, migration, rows, step)

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
        # Steps of the following phase already done (`next` began it): the command stopped
        # inside that phase, where the next thing to do is to finish it, not to deploy.
        for phase in self.pattern.phases[reached_index + 1 : reached_index + 2]:
            if any(s.id in rows and rows[s.id].state == "done" for s in phase.steps):
                result.inside = phase.name
        ledger.set_phase(
            self.conn, migration.id, reached, "completed" if result.completed else "active"
        )
        return result

    # -- status, verify, rollback, reset -------------------------------------------------------

    def status(self) -> dict[str, Any]:
        migration = self._latest()
        if migration is None:
            return unrecorded_document(
                self.table_label, self.pattern.name,
                first_phase=self.pattern.phases[0].name, active_pattern=None,
            )  # fmt: skip
        return recorded_document(self.table_label, self.pattern, migration, self._rows(migration))

    def current_phase(self) -> str:
        migration = self._latest()
        if migration is None:
            return self.pattern.phases[0].name
        return reached_phase(self.pattern, migration.current_phase, self._rows(migration))

    def verify(self) -> list[str]:
        """Violations of the current phase's invariants (empty: all hold)."""
        phase = self.current_phase()
        rows = self._existing_rows()
        done = frozenset(i for i, row in rows.items() if row.state == "done")
        return self._facts_now().violations(self.pattern.verified(phase, done))

    def rollback(self, to_phase: str) -> list[str]:
        """Undo, newest first, every done step after `to_phase` (see `reverse.rollback`)."""
        self.acquire()
        phase_index(self.pattern, to_phase)  # an unknown phase is refused before anything else
        migration = self._latest()
        if migration is None:
            raise OutOfOrder(
                f"no {self.pattern.acronym} migration of {self.table_label} to roll back"
            )
        return rollback_to(self._applier(migration.id), self.pattern, migration, to_phase)

    def reset(self, *, force: bool = False) -> bool:
        """Abandon the table's active migration record (schema objects are left as they are).
        Refused while steps of it are applied, unless `force` — the record is what knows how
        to undo them — and for another pattern, `force` or not (`decide.check_reset`)."""
        self.acquire()
        active = (
            ledger.active_for_table(self.conn, self.spec)
            if ledger.ledger_exists(self.conn)
            else None
        )
        if active is None:
            # Nothing to abandon; a table that is not there is bad input, as for `run`.
            require_table(self.conn, self.spec)
            return False
        rows = self._rows(active) if active.pattern == self.pattern.name else {}
        check_reset(self.pattern, active.pattern, rows, force=force, table=self.table_label)
        ledger.abandon(self.conn, active.id)
        return True
