"""Evaluating a step's conditions: which run before its transaction, which under its locks
(docs/runner.md, "What is guaranteed at commit").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from psycopg import Connection

from outbox_migrate.errors import PreconditionFailed, first_of
from outbox_migrate.patterns.model import CheckPoint, Condition, Step


def violations(conn: Connection[Any], conditions: Iterable[Condition]) -> list[str]:
    found: list[str] = []
    for condition in conditions:
        rows = conn.execute(condition.query).fetchall()
        found.extend(str(r[0]) for r in rows)
    return found


def check_conditions(conn: Connection[Any], label: str, conditions: Iterable[Condition]) -> None:
    """Raise `PreconditionFailed` on the first condition with a violation."""
    for condition in conditions:
        rows = conn.execute(condition.query).fetchall()
        if rows:
            raise PreconditionFailed(label, condition.name, first_of([r[0] for r in rows]))


def before_transaction(step: Step) -> tuple[Condition, ...]:
    """What is checked before the step's transaction: the sampled and scanning checks, and
    the LOCKED ones once as well, so a step that cannot apply is refused without ever
    queueing for a lock (they are checked again under the lock)."""
    early = tuple(c for c in step.preconditions if c.at is not CheckPoint.LOCKED)
    return early + step.conditions_at(CheckPoint.LOCKED)
