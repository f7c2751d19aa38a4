"""`status` rendered in one place: the document `outbox-migrate status` prints (and
`Runner.status()` returns), from a pattern and what the ledger records. Pure, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from outbox_migrate.patterns.model import Pattern
from outbox_migrate.runner.decide import phase_index, reached_phase
from outbox_migrate.runner.ledger import MigrationRow, StepRow


def recorded_document(
    table: str, pattern: Pattern, migration: MigrationRow, rows: Mapping[str, StepRow]
) -> dict[str, Any]:
    """A migration the ledger records: its state, the phase its steps prove, every step."""
    reached = reached_phase(pattern, migration.current_phase, rows)
    index = phase_index(pattern, reached)
    following = pattern.phases[index + 1].name if index + 1 < len(pattern.phases) else None
    return {
        "table": table,
        "pattern": pattern.name,
        "recorded": True,
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
            for step in pattern.steps()
        ],
    }


def unrecorded_document(
    table: str, pattern: str | None, *, first_phase: str | None, active_pattern: str | None
) -> dict[str, Any]:
    """No migration of this pattern (or none at all) is recorded for the table."""
    document: dict[str, Any] = {
        "table": table,
        "pattern": pattern,
        "recorded": False,
        "state": "not started",
        "phase": first_phase,
        "next_phase": None,
        "steps": [],
    }
    if active_pattern is not None:
        document["active_pattern"] = active_pattern
    return document
