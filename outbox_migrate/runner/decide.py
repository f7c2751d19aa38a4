"""What happens next: pure functions of (pattern, ledger rows, observed facts). No I/O.

The engine asks these questions and then acts; keeping them pure lets the unit tests walk
every combination of ledger state and postcondition outcome.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from outbox_migrate.patterns.model import Pattern, Step
from outbox_migrate.runner.errors import OutOfOrder
from outbox_migrate.runner.ledger import StepRow


class Action(StrEnum):
    ALREADY_DONE = "already-done"
    """The ledger says done: skip without touching the database."""
    ADOPT = "adopt"
    """Not recorded as done, but the postcondition holds (a crash after COMMIT of a
    non-transactional step, or work applied by hand): record it as done, run nothing."""
    RUN = "run"


def action_for(step: Step, row: StepRow | None, postcondition_holds: bool | None) -> Action:
    """`postcondition_holds` is None when it was not evaluated (the ledger already says done)."""
    if row is not None and row.state == "done":
        return Action.ALREADY_DONE
    if step.postcondition and postcondition_holds:
        return Action.ADOPT
    return Action.RUN


def completed_phase(pattern: Pattern, rows: Mapping[str, StepRow]) -> str:
    """The last phase whose steps (and all earlier ones) are done in the ledger."""
    reached = pattern.phases[0].name
    for phase in pattern.phases:
        if all(rows.get(s.id) is not None and rows[s.id].state == "done" for s in phase.steps):
            reached = phase.name
        else:
            break
    return reached


def phase_index(pattern: Pattern, name: str) -> int:
    for index, phase in enumerate(pattern.phases):
        if phase.name.lower() == name.lower():
            return index
    raise OutOfOrder(
        f"pattern {pattern.acronym} has no phase {name!r}; its phases are "
        + ", ".join(pattern.phase_names())
    )


def steps_to_run(pattern: Pattern, rows: Mapping[str, StepRow], target: str) -> list[Step]:
    """Steps from the first unfinished one through the end of `target`.

    Refuses to cross more than one deploy boundary: the steps of phase N+1 assume phase N's
    application version is fully rolled out, which the runner cannot do for you.
    """
    goal = phase_index(pattern, target)
    done = phase_index(pattern, completed_phase(pattern, rows))
    later_done = any(
        rows.get(s.id) is not None and rows[s.id].state == "done"
        for phase in pattern.phases[goal + 1 :]
        for s in phase.steps
    )
    if goal < done and later_done:
        raise OutOfOrder(
            f"phase {pattern.phases[goal].name} is already behind (completed through "
            f"{pattern.phases[done].name}); use `outbox-migrate rollback --to "
            f"{pattern.phases[goal].name}` to go back"
        )
    if goal > done + 1:
        nxt = pattern.phases[done + 1].name
        raise OutOfOrder(
            f"{pattern.phases[goal].name} before {nxt}: run --to {nxt} first, deploy {nxt}, "
            f"then run --to {pattern.phases[goal].name}"
        )
    pending: list[Step] = []
    for phase in pattern.phases[: goal + 1]:
        pending.extend(
            s for s in phase.steps if rows.get(s.id) is None or rows[s.id].state != "done"
        )
    return pending


def steps_to_reverse(pattern: Pattern, rows: Mapping[str, StepRow], target: str) -> list[Step]:
    """Done steps after `target`, newest first (the order their inverses must run)."""
    goal = phase_index(pattern, target)
    later = [s for phase in pattern.phases[goal + 1 :] for s in phase.steps]
    return [s for s in reversed(later) if rows.get(s.id) is not None and rows[s.id].state == "done"]
