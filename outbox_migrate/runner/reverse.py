"""Going back: `rollback --to` and Alembic downgrades, one step's inverse at a time, by the
forward rule (locks, checks, ownership, then the work, in one transaction).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import psycopg

from outbox_migrate.db import one_line
from outbox_migrate.errors import ConnectionLost, OutOfOrder, PreconditionFailed, StepFailed
from outbox_migrate.patterns.model import Pattern, Step
from outbox_migrate.runner import ledger, ownership
from outbox_migrate.runner.apply import StepApplier, connection_lost
from outbox_migrate.runner.checks import check_conditions
from outbox_migrate.runner.decide import (
    completed_phase,
    irreversible,
    phase_index,
    reached_phase,
    steps_to_reverse,
)


def run_inverse(applier: StepApplier, step: Step) -> None:
    """A step's inverse in one transaction, under the same lock budget as forward steps
    (no statement_timeout: undoing the swap validates a CHECK on the detached table)."""
    statements = step.reverse or ()
    label = f"{step.id} (reverse)"
    migration_id = applier.migration_id

    def body(conn: psycopg.Connection[Any]) -> None:
        check_conditions(conn, label, step.reverse_preconditions)
        if statements:
            ownership.check_droppable(conn, migration_id, step, applier.spec)
        if migration_id is not None:
            ledger.transition(conn, migration_id, step.id, "rolled_back")
            conn.execute(
                "DELETE FROM outbox_migrate.owned_object WHERE migration_id = %s AND step_id = %s",
                (migration_id, step.id),
            )
        for statement in statements:
            conn.execute(statement)
        if migration_id is not None and step.reverse_creates:
            ownership.record(
                conn, migration_id, step, applier.spec, "created", objects=step.reverse_creates
            )

    try:
        applier.in_step_transaction(step, label, applier.budget(), body)
    except psycopg.Error as exc:
        conn = applier.conn
        dsn = applier.options.dsn
        if connection_lost(exc, conn if not conn.closed else None):
            raise ConnectionLost(f"the inverse of {step.id}", one_line(str(exc), dsn)) from None
        raise StepFailed(label, one_line(str(exc), dsn)) from None


def reverse_one(
    applier: StepApplier,
    pattern: Pattern,
    migration: ledger.MigrationRow | None,
    rows: Mapping[str, ledger.StepRow],
    step: Step,
) -> bool:
    """Undo one step (Alembic downgrade). False when it was never applied."""
    if step.reverse is None:
        raise irreversible(step)
    steps = pattern.steps()
    later = steps[steps.index(step) + 1 :]
    ahead = [s.id for s in later if s.id in rows and rows[s.id].state == "done"]
    if ahead:
        raise OutOfOrder(f"roll back {ahead[-1]} before {step.id}")
    recorded = step.id in rows and rows[step.id].state == "done"
    if not recorded and not (step.postcondition and not applier.violations(step.postcondition)):
        return False
    applier.events.step_started(step, "reverse")
    started = time.monotonic()
    try:
        run_inverse(applier, step)
    except KeyboardInterrupt:
        applier.interrupted(step, undoing=True)
        raise
    if migration is not None:
        reached = completed_phase(pattern, ledger.step_rows(applier.conn, migration.id))
        ledger.set_phase(applier.conn, migration.id, reached, "active")
    applier.events.step_finished(step, "rolled back", time.monotonic() - started)
    return True


def rollback(
    applier: StepApplier, pattern: Pattern, migration: ledger.MigrationRow, to_phase: str
) -> list[str]:
    """Undo, newest first, every done step after `to_phase`; refuse past an irreversible
    step (the pattern's point of no return) and refuse a phase that is ahead, not behind."""
    goal = phase_index(pattern, to_phase)
    rows = ledger.step_rows(applier.conn, migration.id)
    current = reached_phase(pattern, migration.current_phase, rows)
    if goal > phase_index(pattern, current):
        raise OutOfOrder(
            f"{pattern.phases[goal].name} is ahead of the current phase {current}: rollback "
            f"goes back only; use `outbox-migrate run --to {pattern.phases[goal].name}` to "
            "go forward"
        )
    undo = steps_to_reverse(pattern, rows, to_phase)
    if not undo:
        # Nothing after `to_phase` is applied: a rollback that undoes nothing changes nothing
        # (it set a completed migration back to `active`).
        return []
    for step in undo:
        if step.reverse is None:
            raise OutOfOrder(f"cannot roll back past {step.id}: {step.reverse_note}")

    # Refuse up front what would refuse half-way: a table that holds rows is never dropped,
    # and no inverse before it removes rows, so its emptiness check can be made now (else
    # HOPIA's rollback could remove the copy trigger, then stop at the published partition).
    def check_emptiness(conn: psycopg.Connection[Any]) -> None:
        for step in undo:
            check_conditions(
                conn,
                f"{step.id} (reverse)",
                [c for c in step.reverse_preconditions if c.name.startswith("relation-empty")],
            )

    relations = sorted({lock.relation for step in undo for lock in step.locks})
    applier.read_under_budget(f"{pattern.name} rollback", relations, check_emptiness)
    reversed_ids: list[str] = []
    for step in undo:
        applier.events.step_started(step, "reverse")
        started = time.monotonic()
        try:
            run_inverse(applier, step)
        except KeyboardInterrupt:  # the inverse may have committed: the ledger says
            applier.interrupted(step, undoing=True)
            raise
        except PreconditionFailed:
            # Whatever was undone so far stays undone and recorded; the ledger's phase says
            # where the migration now stands.
            reached = completed_phase(pattern, ledger.step_rows(applier.conn, migration.id))
            ledger.set_phase(applier.conn, migration.id, reached, "active")
            raise
        reversed_ids.append(step.id)
        applier.events.step_finished(step, "rolled back", time.monotonic() - started)
    ledger.set_phase(applier.conn, migration.id, to_phase, "active")
    return reversed_ids
