"""The runner's pure decisions: what to do with a step, which steps a `run --to` may run."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from outbox_migrate.errors import OutOfOrder
from outbox_migrate.patterns import BuildOptions, build_pattern
from outbox_migrate.runner.decide import (
    Action,
    action_for,
    completed_phase,
    skipped,
    steps_to_reverse,
    steps_to_run,
)
from outbox_migrate.runner.ledger import StepRow

HOPER = build_pattern("hoper")


def row(step_id: str, state: str) -> StepRow:
    now = datetime.now(UTC)
    return StepRow(step_id, 0, "V2", "k", "c", state, 1, now, now, 1.0, 0.0, None, None, None)


def rows_done_through(phase: str) -> dict[str, StepRow]:
    return {s.id: row(s.id, "done") for s in HOPER.steps_through(phase)}


@pytest.mark.parametrize(
    ("state", "holds", "expected"),
    [
        (None, False, Action.RUN),
        (None, True, Action.ADOPT),
        ("pending", False, Action.RUN),
        ("running", True, Action.ADOPT),  # crashed after COMMIT: the work is there
        ("running", False, Action.RUN),  # crashed before COMMIT: nothing happened
        ("failed", False, Action.RUN),
        ("failed", True, Action.ADOPT),
        ("rolled_back", False, Action.RUN),
        ("done", None, Action.ALREADY_DONE),
        ("done", False, Action.ALREADY_DONE),
    ],
)
def test_action_for(state: str | None, holds: bool | None, expected: Action) -> None:
    step = HOPER.steps()[0]
    current = row(step.id, state) if state else None
    assert action_for(step, current, holds) is expected


def test_gate_without_postcondition_always_runs_until_recorded() -> None:
    gate = HOPER.phase("V3").steps[0]
    assert gate.postcondition == ()
    assert action_for(gate, row(gate.id, "running"), False) is Action.RUN
    assert action_for(gate, row(gate.id, "done"), None) is Action.ALREADY_DONE


def test_completed_phase() -> None:
    assert completed_phase(HOPER, {}) == "V1"
    assert completed_phase(HOPER, rows_done_through("V2")) == "V2"
    partial = rows_done_through("V3")
    first_v4 = HOPER.phase("V4").steps[0]
    partial[first_v4.id] = row(first_v4.id, "done")
    assert completed_phase(HOPER, partial) == "V3"
    assert completed_phase(HOPER, rows_done_through("copy-back")) == "copy-back"


def test_steps_to_run_stops_at_the_boundary() -> None:
    pending = steps_to_run(HOPER, {}, "V2")
    assert [s.phase for s in pending] == ["V2"] * len(HOPER.phase("V2").steps)
    assert steps_to_run(HOPER, rows_done_through("V2"), "V2") == []


def test_v3_before_v2_is_out_of_order() -> None:
    with pytest.raises(OutOfOrder, match="V3 before V2"):
        steps_to_run(HOPER, {}, "V3")


def test_going_backwards_points_to_rollback() -> None:
    with pytest.raises(OutOfOrder, match="rollback --to V2"):
        steps_to_run(HOPER, rows_done_through("V4"), "V2")


def test_unknown_phase() -> None:
    with pytest.raises(OutOfOrder, match="no phase 'V9'"):
        steps_to_run(HOPER, {}, "V9")


def test_resume_runs_only_the_unfinished_steps() -> None:
    rows = rows_done_through("V3")
    v4 = HOPER.phase("V4").steps
    rows[v4[0].id] = row(v4[0].id, "done")
    rows[v4[1].id] = row(v4[1].id, "running")
    assert [s.id for s in steps_to_run(HOPER, rows, "V4")] == [s.id for s in v4[1:]]


def test_steps_to_reverse_newest_first() -> None:
    rows = rows_done_through("V4")
    undo = steps_to_reverse(HOPER, rows, "V3")
    assert [s.id for s in undo] == [s.id for s in reversed(HOPER.phase("V4").steps)]
    assert steps_to_reverse(HOPER, rows, "V4") == []


def test_optional_steps_passed_by_stay_passed_by() -> None:
    """A migration run to its end without --with-optional, then `run --with-optional` to take
    the original name: V4's optional steps (set-not-null needs the CHECK drop-check removed)
    are not run, V4 counts as complete, and HOPIA's trailing optional drop still runs."""
    for name, trailing in (("hoper", None), ("hopia", "hopia.v4.drop-detached-published")):
        plain = build_pattern(name)
        full = build_pattern(name, options=BuildOptions(include_optional=True))
        rows = {s.id: row(s.id, "done") for s in plain.steps()}
        assert completed_phase(full, rows) == plain.phases[-1].name
        pending = [s.id for s in steps_to_run(full, rows, "original-name")]
        expected = [f"{name}.original-name.take-original-name"]
        assert pending == ([trailing, *expected] if trailing else expected)
        assert f"{name}.v4.set-not-null" in skipped(full, rows)


def test_a_running_step_after_the_target_is_rolled_back_too() -> None:
    """A copy-back interrupted part-way stays `running`. Rollback to V3 skipped it (only done
    steps were undone): the migration stood at V3 with a running copy-back, which a later
    `run --to copy-back` adopted as finished."""
    rows = rows_done_through("V4")
    copy_back = HOPER.phase("copy-back").steps[0]
    rows[copy_back.id] = row(copy_back.id, "running")
    undo = steps_to_reverse(HOPER, rows, "V3")
    assert undo[0].id == copy_back.id
    assert [s.id for s in undo[1:]] == [s.id for s in reversed(HOPER.phase("V4").steps)]
