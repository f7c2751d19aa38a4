"""The step-kind toolkit every kind module builds with: the build context, the `kind`
registry decorator, `make_step` and the statement timeouts. Kept apart from the package's
`__init__` (which loads every kind) so a kind module imports this, never the package: no
import circle between the registry and the kinds it registers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from outbox_migrate.patterns.model import (
    Condition,
    Created,
    Lock,
    PublicationFact,
    Statement,
    Step,
    TxMode,
)
from outbox_migrate.patterns.names import Names

CATALOG_TIMEOUT_MS = 2_000
"""statement_timeout of catalog-only DDL: generous for catalog work, fatal for a table scan."""
SCAN_GUARD_TIMEOUT_MS = 1_000
"""ATTACH runs under this: if PostgreSQL decided to scan after all, it fails in a second
instead of holding ACCESS EXCLUSIVE for minutes."""
CREATE_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class BuildContext:
    """What a kind needs to build its step: names, position in the pattern, options."""

    names: Names
    pattern: str
    phase: str
    app_before: str
    app_after: str
    sample_window_s: float
    old_app_name: str
    identity_generation: str = "ALWAYS"
    """How the old table's identity was generated (for reversing DROP IDENTITY)."""
    publications: tuple[PublicationFact, ...] = ()
    """Publications covering the old table (introspected): CDC users' streams to carry."""

    def step_id(self, kind: str) -> str:
        return f"{self.pattern}.{self.phase.lower()}.{kind}"

    def deploy_gate(self, relation: str) -> tuple[Condition, ...]:
        """The checks that prove the previous version stopped writing to `relation`: the
        gate sequence's window and its re-check under the step's lock
        (kinds/gate_sequence.py), never the id's sequence, which an INSERT that supplies its
        id does not touch; and the outgoing version's sessions when their name is known."""
        from outbox_migrate.patterns import conditions as c

        checks = [
            c.no_new_ticks(self.names, relation, self.phase, self.sample_window_s),
            c.no_new_ticks_since_sample(self.names, relation, self.phase),
        ]
        if self.old_app_name:
            checks.append(c.no_old_app_sessions(self.old_app_name, self.phase))
        return tuple(checks)


StepBuilder = Callable[[BuildContext, Mapping[str, Any]], Step | None]
"""A kind returns None when it does not apply to this outbox (e.g. the gate sequence for
database ids): the pattern then has no such step."""
REGISTRY: dict[str, StepBuilder] = {}


def kind(name: str) -> Callable[[StepBuilder], StepBuilder]:
    """Register a step builder under the name pattern files use."""

    def register(builder: StepBuilder) -> StepBuilder:
        if name in REGISTRY:
            raise ValueError(f"step kind {name!r} registered twice")
        REGISTRY[name] = builder
        return builder

    return register


def make_step(
    ctx: BuildContext,
    kind_name: str,
    *,
    summary: str,
    statements: tuple[Statement, ...],
    tx: TxMode,
    locks: tuple[Lock, ...],
    preconditions: tuple[Condition, ...],
    postcondition: tuple[Condition, ...],
    reverse: tuple[Statement, ...] | None,
    reverse_note: str,
    reverse_preconditions: tuple[Condition, ...] = (),
    scan: str = "",
    statement_timeout_ms: int | None = CATALOG_TIMEOUT_MS,
    optional: bool = False,
    catalog_only: bool = False,
    notes: tuple[str, ...] = (),
    undone_by: tuple[str, ...] = (),
    creates: tuple[Created, ...] = (),
    reverse_creates: tuple[Created, ...] = (),
    executor: str = "sql",
    restates_end_state: bool = False,
) -> Step:
    return Step(
        id=ctx.step_id(kind_name),
        kind=kind_name,
        phase=ctx.phase,
        summary=summary,
        app_before=ctx.app_before,
        app_after=ctx.app_after,
        statements=statements,
        tx=tx,
        locks=locks,
        scan=scan,
        preconditions=preconditions,
        postcondition=postcondition,
        reverse=reverse,
        reverse_note=reverse_note,
        reverse_preconditions=reverse_preconditions,
        statement_timeout_ms=statement_timeout_ms,
        optional=optional,
        catalog_only=catalog_only,
        notes=notes,
        undone_by=undone_by,
        creates=creates,
        reverse_creates=reverse_creates,
        executor=executor,
        restates_end_state=restates_end_state,
    )
