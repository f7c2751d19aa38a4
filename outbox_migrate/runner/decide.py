"""What happens next: pure functions of (pattern, ledger rows, observed facts). No I/O.

A ledger row is anything with a `state` (`StepRow`, or `Assumed` for "as the plan will leave
it").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from outbox_migrate.errors import OutOfOrder, PreconditionFailed, StepChanged, UsageError
from outbox_migrate.patterns.model import Condition, Pattern, Step, TxMode

# -- what a holding postcondition proves about the past ----------------------------------
#
# A postcondition that asserts a *presence* (the old table is the DEFAULT partition, the CHECK
# is validated) is false until its step ran, so finding it true proves the step — and, since a
# pattern's steps apply in order, every step before it — was applied. A postcondition that
# asserts only *absences* (the CHECK is gone, the trigger is gone) is just as true before the
# step it undoes was ever applied, so on its own it proves nothing.
#
# Conditions are classified by name. A name in neither set is treated as proving nothing, so a
# new kind can only make the runner more careful, never adopt on a guess; the unit tests check
# that every postcondition of every pattern is classified.

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


class HasState(Protocol):
    @property
    def state(self) -> str: ...


@dataclass(frozen=True)
class Assumed:
    """A ledger row as an admitted plan will leave it (to check the rule that follows)."""

    state: str


Rows = Mapping[str, HasState]


def _done(rows: Rows, step_id: str) -> bool:
    row = rows.get(step_id)
    return row is not None and row.state == "done"


class Action(StrEnum):
    ALREADY_DONE = "already-done"
    """The ledger says done: skip without touching the database."""
    ADOPT = "adopt"
    """Not recorded as done, but the postcondition holds (a crash after COMMIT of a
    non-transactional step, or work applied by hand): record it as done, run nothing."""
    RUN = "run"
    """Hand the step to its executor (which still adopts it if its postcondition holds by
    the time it runs)."""
    UNDONE = "undone"
    """Applied, then undone on purpose by a later step that is evidenced (or a deploy gate
    passed before an evidenced later step): record it done and adopt no object (its objects
    are gone)."""


def action_for(step: Step, row: HasState | None, postcondition_holds: bool | None) -> Action:
    """`postcondition_holds` is None when it was not evaluated (the ledger already says done)."""
    if row is not None and row.state == "done":
        return Action.ALREADY_DONE
    if step.postcondition and postcondition_holds:
        return Action.ADOPT
    return Action.RUN


def skipped(pattern: Pattern, rows: Rows) -> frozenset[str]:
    """Optional steps left out for good: not done, and a later step of the pattern is.

    A migration run without --with-optional passes its optional steps by (SET NOT NULL,
    disabling the old triggers); once a later step ran, the state they were written for is
    gone (V4's `set-not-null` needs the CHECK `drop-check` removed), so a later
    `run --with-optional` (to take the original name) must not run them, nor wait for them."""
    left: set[str] = set()
    later_done = False
    for step in reversed(pattern.steps()):
        if _done(rows, step.id):
            later_done = True
        elif step.optional and later_done:
            left.add(step.id)
    return frozenset(left)


def completed_phase(pattern: Pattern, rows: Rows) -> str:
    """The last phase whose required steps (and all earlier ones) are done in the ledger: an
    optional step of a required phase is not required (the migration is complete without
    it); an optional phase's steps are."""
    reached = pattern.phases[0].name
    for phase in pattern.phases:
        if all(_done(rows, s.id) for s in phase.steps if phase.optional or not s.optional):
            reached = phase.name
        else:
            break
    return reached


def step_named(pattern: Pattern, step_id: str) -> Step:
    """The pattern's step called `step_id` (a `UsageError` names the known ones)."""
    for step in pattern.steps():
        if step.id == step_id:
            return step
    raise UsageError(
        f"pattern {pattern.acronym} has no step {step_id!r}; its steps are "
        + ", ".join(s.id for s in pattern.steps())
    )


def irreversible(step: Step) -> OutOfOrder:
    return OutOfOrder(f"cannot roll back {step.id}: {step.reverse_note}")


def phase_index(pattern: Pattern, name: str) -> int:
    for index, phase in enumerate(pattern.phases):
        if phase.name.lower() == name.lower():
            return index
    raise OutOfOrder(
        f"pattern {pattern.acronym} has no phase {name!r}; its phases are "
        + ", ".join(pattern.phase_names())
    )


def steps_to_run(pattern: Pattern, rows: Rows, target: str) -> list[Step]:
    """Steps from the first unfinished one through the end of `target`.

    Refuses to cross more than one deploy boundary: the steps of phase N+1 assume phase N's
    application version is fully rolled out, which the runner cannot do for you.
    """
    goal = phase_index(pattern, target)
    done = phase_index(pattern, completed_phase(pattern, rows))
    later_done = any(_done(rows, s.id) for phase in pattern.phases[goal + 1 :] for s in phase.steps)
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
    passed = skipped(pattern, rows)
    pending: list[Step] = []
    for phase in pattern.phases[: goal + 1]:
        pending.extend(s for s in phase.steps if not _done(rows, s.id) and s.id not in passed)
    return pending


def steps_to_reverse(pattern: Pattern, rows: Rows, target: str) -> list[Step]:
    """Steps after `target` the ledger records done or running, newest first (the order
    their inverses must run). A running one is an interrupted job (HOPER's copy-back):
    skipped, it stayed `running` under a migration rolled back before it, and a later run
    adopted it as finished (its postcondition read the rolled-back tables) — copying nothing
    more before the old table was dropped."""
    goal = phase_index(pattern, target)
    later = [s for phase in pattern.phases[goal + 1 :] for s in phase.steps]
    return [s for s in reversed(later) if _taken(rows, s.id)]


def _taken(rows: Rows, step_id: str) -> bool:
    row = rows.get(step_id)
    return row is not None and row.state in ("done", "running")


def reached_phase(pattern: Pattern, recorded: str, rows: Rows) -> str:
    """The phase the ledger records as reached, never beyond what its steps prove."""
    proven = phase_index(pattern, completed_phase(pattern, rows))
    try:
        index = phase_index(pattern, recorded)
    except OutOfOrder:
        index = proven
    return pattern.phases[min(proven, index)].name


def check_definitions(pattern: Pattern, checksums: Mapping[str, tuple[str, str]]) -> None:
    """Refuse (before anything is written) a step applied with a definition it no longer has.

    `checksums`: step id → (recorded state, recorded checksum). A done or running step whose
    checksum changed may no longer be described by its postcondition; an earlier release's
    definition with the same postcondition (`former_checksums`) is the one exception."""
    for step in pattern.steps():
        if step.id not in checksums:
            continue
        state, recorded = checksums[step.id]
        current = step.checksum()
        if recorded == current or state not in ("done", "running"):
            continue
        if state == "done" and recorded in step.former_checksums:
            continue
        raise StepChanged(step.id, recorded, current)


@dataclass(frozen=True)
class StepPlan:
    """What `execute_step` would do, decided before anything is written: the earlier steps
    it adopts (postcondition holds), records as undone on purpose, or runs (deploy gates),
    then the target. `actions` is in pattern order, the target last."""

    target: Step
    actions: tuple[tuple[Step, Action], ...]

    def ids(self, action: Action) -> list[str]:
        return [step.id for step, chosen in self.actions if chosen is action]


def plan_execute_step(
    pattern: Pattern, rows: Rows, target_id: str, holds: Mapping[str, bool]
) -> StepPlan:
    """Decide `execute_step(target_id)` from the ledger and the live facts, or refuse.

    `holds`: step id → its postcondition holds now, for the steps not done in the ledger.
    Every earlier step must be done, proven by its postcondition, evidenced as undone on
    purpose by a later step (`undone_on_purpose`), or a step without SQL to run again (a
    deploy gate: checked live). Anything else refuses (`OutOfOrder`) with nothing written.
    Then `run`'s deploy-boundary rule must hold for the ledger as the plan would leave it."""
    steps = pattern.steps()
    by_id = {step.id: step for step in steps}
    target = by_id[target_id]
    if _done(rows, target.id):
        return StepPlan(target, ((target, Action.ALREADY_DONE),))
    before = steps[: steps.index(target)]
    passed = skipped(pattern, rows)
    actions: list[tuple[Step, Action]] = []
    for index, earlier in enumerate(before):
        if _done(rows, earlier.id) or earlier.id in passed:
            continue
        if earlier.postcondition and holds.get(earlier.id, False):
            actions.append((earlier, Action.ADOPT))
        elif undone_on_purpose(before, index, rows, holds) or _gate_passed(
            before, index, rows, holds
        ):
            actions.append((earlier, Action.UNDONE))
        elif earlier.tx is TxMode.NONE:
            actions.append((earlier, Action.RUN))
        else:
            raise OutOfOrder(
                f"{target.id} needs {earlier.id} first, and it is not done "
                "(apply the revisions in order)"
            )
    assumed: dict[str, HasState] = dict(rows)
    assumed.update((step.id, Assumed("done")) for step, _ in actions)
    steps_to_run(pattern, assumed, target.phase)  # the deploy-boundary rule of `run`
    return StepPlan(target, (*actions, (target, Action.RUN)))


def _evidenced(step: Step, rows: Rows, holds: Mapping[str, bool]) -> bool:
    """Done in the ledger, or a presence postcondition holds: the step was applied."""
    if _done(rows, step.id):
        return True
    return bool(step.postcondition) and holds.get(step.id, False) and asserts_presence(step)


def _gate_passed(before: list[Step], index: int, rows: Rows, holds: Mapping[str, bool]) -> bool:
    """A deploy gate (no SQL) followed by a step that is evidenced was passed when that step
    was applied (steps apply in order; offline SQL carries the gate's assertions). It cannot
    always be checked again: the gate sequence it reads is removed after the last gate."""
    earlier = before[index]
    if earlier.tx is not TxMode.NONE or earlier.statements:
        return False
    return any(_evidenced(step, rows, holds) for step in before[index + 1 :])


def undone_on_purpose(
    before: list[Step], index: int, rows: Rows, holds: Mapping[str, bool]
) -> bool:
    """Whether a later step in `before` deliberately undid `before[index]` (so its own
    postcondition no longer holds although it was applied).

    The undoer must be evidenced: done in the ledger, or its postcondition holds and
    asserts a presence (swap-default: the old table *is* the DEFAULT partition) — its own
    evidence. An undoer whose postcondition is only absences (drop-check: the CHECK is gone)
    holds just as well before the undone step ever ran, so it counts only when a later step
    is evidenced, between the two or after the undoer: that one could only be applied after
    the undone step was (steps apply in order)."""
    earlier = before[index]
    for position in range(index + 1, len(before)):
        undoer = before[position]
        if undoer.kind not in earlier.undone_by:
            continue
        if _done(rows, undoer.id):
            return True
        if not (undoer.postcondition and holds.get(undoer.id, False)):
            continue
        if asserts_presence(undoer):
            return True
        if any(_evidenced(step, rows, holds) for step in before[index + 1 :]):
            return True
    return False


def check_reset(
    pattern: Pattern, active_pattern: str, rows: Rows, *, force: bool, table: str
) -> None:
    """Refuse a `reset` that would lose what only the record knows, before it writes.

    A pattern that is not the active migration's is refused even with `--force`: another
    pattern's run would then adopt its objects half-way. `--force` only skips the "nothing
    applied" rule."""
    if active_pattern != pattern.name:
        raise OutOfOrder(
            f"the active migration of {table} is a {active_pattern.upper()} one, not "
            f"{pattern.acronym}: reset --pattern {active_pattern}"
        )
    if force:
        return
    applied = steps_to_reverse(pattern, rows, pattern.phases[0].name)
    if applied:
        first = pattern.phases[0].name
        raise PreconditionFailed(
            "reset",
            "nothing-applied",
            f"{len(applied)} step(s) of this migration are applied (latest {applied[0].id}) "
            f"and only its record can undo them: run `outbox-migrate rollback --pattern "
            f"{pattern.name} --to {first}` first, or `reset --force` to abandon it with the "
            "schema as it is",
        )
