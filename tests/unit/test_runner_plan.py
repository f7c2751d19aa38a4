"""The runner's plan, decided without a server: what `execute_step` adopts, records as undone,
runs or refuses; what `reset` refuses; which step transitions exist; and which postconditions
count as evidence that a step was applied."""

from __future__ import annotations

import pytest

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import OutOfOrder, PreconditionFailed, StepChanged
from outbox_migrate.patterns import PATTERN_NAMES, BuildOptions, build_pattern
from outbox_migrate.patterns.model import PublicationFact
from outbox_migrate.runner.decide import (
    ABSENCE,
    PRESENCE,
    Action,
    Assumed,
    asserts_presence,
    base_name,
    check_definitions,
    check_reset,
    plan_execute_step,
    undone_on_purpose,
)
from outbox_migrate.runner.ledger import ALLOWED, STATES, allowed

HOPER = build_pattern("hoper")
COPY_BACK = "hoper.copy-back.copy-back"


def done(*step_ids: str) -> dict[str, Assumed]:
    return {step_id: Assumed("done") for step_id in step_ids}


def ids_through(phase: str) -> list[str]:
    return [s.id for s in HOPER.steps_through(phase)]


def test_an_absence_undoer_alone_adopts_nothing() -> None:
    """The fuzzer's finding: V2, V3 and drop-identity done, then copy-back. drop-check's
    "the CHECK is absent" holds — as it did before the CHECK was ever added — so
    add-not-valid-check is not done: refused, naming it."""
    rows = done(*ids_through("V3"), "hoper.v4.drop-identity")
    holds = {s.id: False for s in HOPER.steps()} | {"hoper.v4.drop-check": True}
    with pytest.raises(OutOfOrder, match=r"needs hoper\.v4\.add-not-valid-check first"):
        plan_execute_step(HOPER, rows, COPY_BACK, holds)


def test_offline_sql_then_online_adopts_through_a_presence() -> None:
    """V2 to V4 applied by psql, nothing in the ledger: swap-default's postcondition (the
    old table *is* the DEFAULT partition) proves it ran, so the published partition it
    detached and the CHECK it needed — dropped since by drop-check — were applied. V3's gate
    was passed before them: it is not run again (the gate sequence it reads is gone)."""
    undone = {
        "hoper.v2.install-gate-sequence",
        "hoper.v2.create-published-partition",
        "hoper.v2.tune-autovacuum",
        "hoper.v4.add-not-valid-check",
        "hoper.v4.validate-check",
    }
    holds = {s.id: s.id not in undone for s in HOPER.steps() if s.postcondition}
    plan = plan_execute_step(HOPER, {}, COPY_BACK, holds)
    assert set(plan.ids(Action.UNDONE)) == undone | {"hoper.v3.gate-old-table-retired"}
    assert plan.ids(Action.RUN) == [COPY_BACK]
    assert "hoper.v4.swap-default" in plan.ids(Action.ADOPT)
    assert [s.id for s, _ in plan.actions] == [s.id for s in HOPER.steps()][: len(plan.actions)]


def test_an_absence_undoer_counts_once_a_step_between_is_evidenced() -> None:
    before = HOPER.steps()[: HOPER.steps().index(HOPER.phase("copy-back").steps[0])]
    index = [s.id for s in before].index("hoper.v4.add-not-valid-check")
    only_absence = {"hoper.v4.drop-check": True}
    assert not undone_on_purpose(before, index, {}, only_absence)
    swap_holds = only_absence | {"hoper.v4.swap-default": True}
    assert undone_on_purpose(before, index, {}, swap_holds)
    assert undone_on_purpose(before, index, done("hoper.v4.validate-check"), only_absence)
    assert undone_on_purpose(before, index, done("hoper.v4.drop-check"), {})


def test_end_of_v2_copy_back_is_refused_before_the_gate_runs() -> None:
    """At the end of V2, copy-back would have run (and recorded) V3's gate on its way to
    refusing: the plan refuses first, with nothing to apply."""
    holds = {s.id: False for s in HOPER.steps() if s.postcondition}
    with pytest.raises(OutOfOrder, match=r"needs hoper\.v4\.drop-identity first"):
        plan_execute_step(HOPER, done(*ids_through("V2")), COPY_BACK, holds)


def test_a_done_target_is_only_skipped() -> None:
    plan = plan_execute_step(HOPER, done(*ids_through("V2")), HOPER.steps()[0].id, {})
    assert plan.actions == ((HOPER.steps()[0], Action.ALREADY_DONE),)


def test_the_plan_keeps_runs_deploy_boundary() -> None:
    """Every earlier step accounted for, the gate to run: V4's first step is admitted."""
    plan = plan_execute_step(HOPER, done(*ids_through("V2")), "hoper.v4.drop-identity", {})
    assert plan.ids(Action.RUN) == ["hoper.v3.gate-old-table-retired", "hoper.v4.drop-identity"]


def test_reset_of_another_pattern_is_refused_even_forced() -> None:
    cop = build_pattern("cop")
    with pytest.raises(OutOfOrder, match="is a HOPER one, not COP: reset --pattern hoper"):
        check_reset(cop, "hoper", {}, force=True, table="public.outbox")


def test_reset_with_applied_steps_needs_force() -> None:
    rows = done(*ids_through("V2"))
    with pytest.raises(PreconditionFailed, match="rollback --pattern hoper --to V1"):
        check_reset(HOPER, "hoper", rows, force=False, table="public.outbox")
    check_reset(HOPER, "hoper", rows, force=True, table="public.outbox")
    check_reset(HOPER, "hoper", {}, force=False, table="public.outbox")


def test_a_changed_definition_is_refused_before_anything_is_written() -> None:
    first = HOPER.steps()[0]
    check_definitions(HOPER, {first.id: ("done", first.checksum())})
    check_definitions(HOPER, {first.id: ("pending", "0" * 16)})  # not applied: updated
    with pytest.raises(StepChanged):
        check_definitions(HOPER, {first.id: ("done", "0" * 16)})


def test_step_transitions() -> None:
    assert set(ALLOWED) == set(STATES)
    assert not allowed("done", "done")  # adopting twice is a bug, not a no-op
    assert not allowed("done", "running")
    assert not allowed("done", "failed")
    assert not allowed("done", "pending")
    assert allowed("done", "rolled_back")
    assert allowed("pending", "done")
    assert allowed("running", "done")  # proven after a crash
    assert not allowed("pending", "unknown")


def _all_postconditions() -> set[str]:
    names: set[str] = set()
    publications = (PublicationFact("pub"), PublicationFact("all", explicit=False, all_tables=True))
    for name in PATTERN_NAMES:
        for spec in (OutboxSpec(), OutboxSpec(id_kind="application")):
            for options in (
                BuildOptions(include_optional=True),
                BuildOptions(identity_generation="BY DEFAULT", publications=publications),
            ):
                for step in build_pattern(name, spec, options).steps():
                    names.update(base_name(c) for c in step.postcondition)
    return names


def test_every_postcondition_is_classified() -> None:
    """A new kind must say whether its postcondition proves it ran (unknown: proves nothing,
    so forgetting this only makes adoption stricter — but this test asks)."""
    assert not PRESENCE & ABSENCE
    unclassified = _all_postconditions() - PRESENCE - ABSENCE
    assert not unclassified, sorted(unclassified)


def test_undoers_are_classified_as_the_rule_needs() -> None:
    steps = {s.kind: s for s in HOPER.steps()}
    assert asserts_presence(steps["swap-default"])
    assert not asserts_presence(steps["drop-check"])


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_an_absence_never_adopts_a_step_not_yet_applied(name: str) -> None:
    """The fuzzer's finding, for every step some later step undoes: everything before it is
    done, it is not, and every absence-only postcondition holds (nothing after it created
    anything) while every presence fails. Asking for any step after its undoer is refused,
    naming it — the undoer's absence is no evidence that it was ever applied."""
    pattern = build_pattern(name, None, BuildOptions(include_optional=True))
    steps = pattern.steps()
    holds = {s.id: not asserts_presence(s) for s in steps if s.postcondition}
    checked = 0
    for index, undone in enumerate(steps):
        undoers = [i for i, s in enumerate(steps) if i > index and s.kind in undone.undone_by]
        if not undoers:
            continue
        rows = done(*(s.id for s in steps[:index]))
        for target in steps[undoers[0] + 1 :]:
            with pytest.raises(OutOfOrder, match=f"needs {undone.id} first"):
                plan_execute_step(pattern, rows, target.id, holds)
            checked += 1
    assert checked or name in ("cop", "hop")  # these two have no undoer in their own steps
