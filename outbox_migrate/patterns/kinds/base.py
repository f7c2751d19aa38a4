"""The step-kind toolkit every kind module builds with: the build options and context, and the
`kind` registry decorator. Apart from the package's `__init__` (which loads every kind), so the
kinds import this and there is no import circle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.model import Condition, PublicationFact, Step
from outbox_migrate.patterns.names import Names

DEFAULT_SAMPLE_WINDOW_S = 2.0
"""How long a deploy gate watches the old table's sequence for new ids."""


@dataclass(frozen=True)
class BuildOptions:
    """Choices that change the concrete steps (and so their checksums)."""

    sample_window_s: float = DEFAULT_SAMPLE_WINDOW_S
    old_app_name: str = ""
    include_optional: bool = False
    identity_generation: str = "ALWAYS"
    """How the old table's identity was generated (for reversing DROP IDENTITY)."""
    publications: tuple[PublicationFact, ...] = ()
    """Publications covering the old table: a conditional step carries them (CDC users)."""


class Place(TypedDict):
    """The `Step` fields that say where a step stands in its pattern."""

    id: str
    kind: str
    phase: str
    app_before: str
    app_after: str


@dataclass(frozen=True)
class BuildContext:
    """What a kind needs to build its step: names, position in the pattern, options."""

    names: Names
    pattern: str
    phase: str
    running: str
    """The application version running while the phase's steps run."""
    options: BuildOptions

    def place(self, kind: str) -> Place:
        """The step's place; `build_pattern` turns the phase's last `app_after` into the
        announcement that the next deploy is ready."""
        step_id = f"{self.pattern}.{self.phase.lower()}.{kind}"
        return Place(id=step_id, kind=kind, phase=self.phase, app_before=self.running,
                     app_after=self.running)  # fmt: skip

    def deploy_gate(self, relation: str) -> tuple[Condition, ...]:
        """The checks that prove the previous version stopped writing to `relation`: the gate
        sequence's window, its re-check under the step's lock, and the outgoing version's
        sessions when their name is known."""
        checks = [
            c.no_new_ticks(self.names, relation, self.phase, self.options.sample_window_s),
            c.no_new_ticks_since_sample(self.names, relation, self.phase),
        ]
        if self.options.old_app_name:
            checks.append(c.no_old_app_sessions(self.options.old_app_name, self.phase))
        return tuple(checks)


StepBuilder = Callable[[BuildContext, Mapping[str, Any]], Step | None]
"""A kind returns None when it does not apply to this outbox (e.g. the guard when
`unpublished_guard` is off): the pattern then has no such step."""
REGISTRY: dict[str, StepBuilder] = {}


def kind(name: str) -> Callable[[StepBuilder], StepBuilder]:
    """Register a step builder under the name pattern files use."""

    def register(builder: StepBuilder) -> StepBuilder:
        if name in REGISTRY:
            raise ValueError(f"step kind {name!r} registered twice")
        REGISTRY[name] = builder
        return builder

    return register
