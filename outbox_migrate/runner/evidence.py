"""What a holding postcondition proves about the past: pure classification, no I/O.

A postcondition that asserts a *presence* (the old table is the DEFAULT partition, the CHECK
is validated) is false until its step ran, so finding it true proves the step — and, since a
pattern's steps apply in order, every step before it — was applied. A postcondition that
asserts only *absences* (the CHECK is gone, the trigger is gone) is just as true before the
step it undoes was ever applied, so on its own it proves nothing.

Conditions are classified by name. A name in neither set is treated as proving nothing, so a
new kind can only make the runner more careful, never adopt on a guess; the unit tests check
that every postcondition of every pattern is classified.
"""

from __future__ import annotations

from outbox_migrate.patterns.model import Condition, Step

PRESENCE = frozenset(
    {
        "all-rows-present",
        "all-rows-present-by-order",
        "autovacuum-tuned",
        "check-exists",
        "check-validated",
        "column-not-null",
        "index-exists",
        "partition-bound",
        "partitioned-by-list",
        "publication-includes",
        "relation-exists",
        "replica-identity-full",
        "trigger-exists",
        "view-over",
        "view-writes-counted",
    }
)
"""Conditions false until the step that establishes them ran."""

ABSENCE = frozenset(
    {
        "check-absent",
        # Holds vacuously while no role has UPDATE on the old table: proves nothing.
        "dead-letter-grants",
        "function-absent",
        "no-enabled-user-triggers",
        "no-identity",
        "not-a-partition-of",
        "relation-absent",
        "trigger-absent",
    }
)
"""Conditions that say something is not there: true before anything was created too."""


def base_name(condition: Condition) -> str:
    """`partition-bound:outbox` → `partition-bound` (the label names the relation)."""
    return condition.name.split(":", 1)[0]


def asserts_presence(step: Step) -> bool:
    """True when the step's postcondition, holding, proves the step was applied."""
    return any(base_name(condition) in PRESENCE for condition in step.postcondition)
