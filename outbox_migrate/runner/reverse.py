"""Going back: `rollback --to` and Alembic downgrades, one step's inverse at a time.

An inverse follows the forward rule: its transaction takes the step's locks first, then
checks its reverse preconditions (an emptiness check made under ACCESS EXCLUSIVE cannot be
stale: no writer can have a row in flight), then proves the objects it drops are this
migration's own (by OID, from the ledger), then acts — all in one transaction, retried
under the lock budget.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import psycopg

from outbox_migrate.db import one_line
from outbox_migrate.errors import ConnectionLost
from outbox_migrate.lock_budget import LockBudget, run_with_lock_budget
from outbox_migrate.patterns.model import LockMode, Step
from outbox_migrate.runner import ledger, ownership
from outbox_migrate.runner.checks import check_conditions
from outbox_migrate.runner.decide import completed_phase, phase_index, steps_to_reverse
from outbox_migrate.runner.errors import OutOfOrder, PreconditionFailed, StepFailed

if TYPE_CHECKING:
    from outbox_migrate.runner.engine import Runner


def run_inverse(runner: Runner, migration_id: int | None, step: Step) -> None:
    """A step's inverse in one transaction, under the same lock budget as forward steps
    (no statement_timeout: undoing the swap validates a CHECK on the detached table)."""
    from outbox_migrate.runner.engine import connection_lost

    statements = step.reverse or ()
    label = f"{step.id} (reverse)"

    def body(conn: psycopg.Connection[Any]) -> None:
        check_conditions(conn, label, step.reverse_preconditions)
        if statements:
            ownership.check_droppable(conn, migration_id, step, runner.spec)
        if migration_id is not None:
            ledger.mark(conn, migration_id, step.id, "rolled_back")
            conn.execute(
                "DELETE FROM outbox_migrate.owned_object WHERE migration_id = %s AND step_id = %s",
                (migration_id, step.id),
            )
        for statement in statements:
            conn.execute(statement)
        if migration_id is not None and step.reverse_creates:
            ownership.record(
                conn, migration_id, step, runner.spec, "created", objects=step.reverse_creates
            )

    budget = LockBudget(runner.settings.lock_timeout_ms, runner.settings.lock_budget_s, None)
    try:
        runner.in_step_transaction(step, label, budget, body)
    except psycopg.Error as exc:
        if connection_lost(exc, runner.conn if not runner.conn.closed else None):
            raise ConnectionLost(
                f"the inverse of {step.id}", one_line(str(exc), runner.dsn)
            ) from None
        raise StepFailed(label, one_line(str(exc), runner.dsn)) from None


def reverse_one(runner: Runner, step_id: str) -> bool:
    """Undo one step (Alembic downgrade). False when it was never applied."""
    step = runner.step(step_id)
    if step.reverse is None:
        raise OutOfOrder(f"cannot roll back {step.id}: {step.reverse_note}")
    runner.acquire()
    migration = runner._latest()
    rows = runner._rows(migration) if migration is not None else {}
    steps = runner.pattern.steps()
    later = steps[steps.index(step) + 1 :]
    ahead = [s.id for s in later if s.id in rows and rows[s.id].state == "done"]
    if ahead:
        raise OutOfOrder(f"roll back {ahead[-1]} before {step.id}")
    recorded = step.id in rows and rows[step.id].state == "done"
    if not recorded and not (step.postcondition and not runner._violations(step.postcondition)):
        return False
    runner.events.step_started(step, "reverse")
    started = time.monotonic()
    run_inverse(runner, migration.id if migration is not None else None, step)
    if migration is not None:
        reached = completed_phase(runner.pattern, runner._rows(migration))
        ledger.set_phase(runner.conn, migration.id, reached, "active")
    runner.events.step_finished(step, "rolled back", time.monotonic() - started)
    return True


def rollback(runner: Runner, to_phase: str) -> list[str]:
    """Undo, newest first, every done step after `to_phase`; refuse past an irreversible
    step (the pattern's point of no return) and refuse a phase that is ahead, not behind."""
    runner.acquire()
    pattern = runner.pattern
    goal = phase_index(pattern, to_phase)  # an unknown phase is refused before anything else
    migration = runner._latest()
    if migration is None:
        raise OutOfOrder(f"no {pattern.acronym} migration of {runner.table_label} to roll back")
    runner._adopt_identity_generation()
    pattern = runner.pattern
    rows = runner._rows(migration)
    current = runner._current_phase(migration, rows)
    if goal > phase_index(pattern, current):
        raise OutOfOrder(
            f"{pattern.phases[goal].name} is ahead of the current phase {current}: rollback "
            f"goes back only; use `outbox-migrate run --to {pattern.phases[goal].name}` to "
            "go forward"
        )
    undo = steps_to_reverse(pattern, rows, to_phase)
    for step in undo:
        if step.reverse is None:
            raise OutOfOrder(f"cannot roll back past {step.id}: {step.reverse_note}")

    # Refuse up front what would refuse half-way: a table that holds rows is never dropped,
    # and no inverse before it removes rows, so its emptiness check can be made now. Without
    # this, HOPIA's rollback to V1 removed the copy trigger, then refused at the published
    # partition — leaving V2 publishing without the trigger and V2 unable to re-apply.
    # These reads wait for nobody: under the lock budget, like a step (a session holding
    # ACCESS EXCLUSIVE on a table is watched and named, never queued behind for ever).
    def check_emptiness(conn: psycopg.Connection[Any]) -> None:
        for step in undo:
            check_conditions(
                conn,
                f"{step.id} (reverse)",
                [c for c in step.reverse_preconditions if c.name.startswith("relation-empty")],
            )

    relations = sorted({lock.relation for step in undo for lock in step.locks})
    run_with_lock_budget(
        runner.conn, f"{pattern.name} rollback",
        LockBudget(runner.settings.lock_timeout_ms, runner.settings.lock_budget_s, None),
        check_emptiness, relations=[(r, LockMode.ACCESS_SHARE) for r in relations],
        schema=runner.spec.schema, watch_blockers=runner.watch_blockers,
    )  # fmt: skip
    reversed_ids: list[str] = []
    for step in undo:
        runner.events.step_started(step, "reverse")
        started = time.monotonic()
        try:
            run_inverse(runner, migration.id, step)
        except PreconditionFailed:
            # Whatever was undone so far stays undone and recorded; the ledger's phase says
            # where the migration now stands.
            reached = completed_phase(pattern, runner._rows(migration))
            ledger.set_phase(runner.conn, migration.id, reached, "active")
            raise
        reversed_ids.append(step.id)
        runner.events.step_finished(step, "rolled back", time.monotonic() - started)
    ledger.set_phase(runner.conn, migration.id, to_phase, "active")
    return reversed_ids
