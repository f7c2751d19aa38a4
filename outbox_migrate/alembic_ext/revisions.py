"""Which Alembic revisions a pattern becomes: pure planning over inert `Pattern` data, with no
Alembic import and no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from outbox_migrate.patterns.model import Pattern, Phase, PhaseKind, Step


class Split(StrEnum):
    """How a phase is cut into revisions."""

    STEP = "step"
    """One revision per step (default): every step already commits in its own transaction,
    so each revision is exactly one transaction — the step, its ledger row and the
    alembic_version update commit together, and a failed check leaves the revision unapplied."""
    PHASE = "phase"
    """One revision per phase: fewer files; each step still gets its own transaction (inside
    `autocommit_block`), so a failure part-way leaves the revision partly applied (an online
    re-run resumes from the ledger)."""


@dataclass(frozen=True)
class RevisionPlan:
    """One revision file to write."""

    rev_id: str
    message: str
    pattern: str
    phase: str
    phase_kind: PhaseKind
    position: int
    """1-based position of the revision within its phase."""
    of: int
    """How many revisions the phase has."""
    step_ids: tuple[str, ...]
    reversible: bool
    summary: str

    @property
    def is_phase_end(self) -> bool:
        """`alembic upgrade <rev_id>` of this revision completes its phase."""
        return self.position == self.of


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def _when(phase: Phase) -> str:
    if phase.kind is PhaseKind.JOB:
        return f"job {phase.name}"
    return f"before deploying {phase.name}"


def plan_revisions(pattern: Pattern, tag: str, split: Split = Split.STEP) -> list[RevisionPlan]:
    """The revisions for `pattern`, in order. `tag` makes the ids unique to one generation
    (`<tag>_hoper_v2_01`); phases without database steps (V1) get no revision."""
    plans: list[RevisionPlan] = []
    for phase in pattern.phases:
        if not phase.steps:
            continue
        groups: list[tuple[Step, ...]] = (
            [(step,) for step in phase.steps] if split is Split.STEP else [phase.steps]
        )
        base = f"{tag}_{pattern.name}_{_slug(phase.name)}"
        for position, group in enumerate(groups, start=1):
            if split is Split.STEP:
                step = group[0]
                rev_id = f"{base}_{position:02d}"
                what = step.id.rsplit(".", 1)[-1]
                message = (
                    f"{what}: {pattern.acronym} {phase.name} {position}/{len(groups)}, "
                    f"{_when(phase)} (outbox-migrate)"
                )
                summary = step.summary
            else:
                rev_id = base
                message = f"{pattern.acronym} {phase.name}, {_when(phase)} (outbox-migrate)"
                summary = phase.title
            plans.append(
                RevisionPlan(
                    rev_id=rev_id,
                    message=message,
                    pattern=pattern.name,
                    phase=phase.name,
                    phase_kind=phase.kind,
                    position=position,
                    of=len(groups),
                    step_ids=tuple(s.id for s in group),
                    reversible=all(s.reversible for s in group),
                    summary=summary,
                )
            )
    return plans


def phase_targets(plans: list[RevisionPlan]) -> dict[str, str]:
    """Phase name → the revision whose upgrade completes it (what CI upgrades to)."""
    return {plan.phase: plan.rev_id for plan in plans if plan.is_phase_end}
