"""The pattern catalog: COP, COPRA, HOP, HOPER and HOPIA as data (`catalog/*.toml`), built into
inert `Step`s for one `OutboxSpec`. A sixth pattern is a TOML file and a test, not new code.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import replace
from functools import cache
from importlib.resources import files
from typing import Any

from outbox_migrate.config import OutboxSpec, Settings
from outbox_migrate.errors import UsageError
from outbox_migrate.patterns import conditions
from outbox_migrate.patterns.kinds import load_all
from outbox_migrate.patterns.kinds.base import BuildContext, BuildOptions
from outbox_migrate.patterns.model import (
    AppBehaviour,
    Pattern,
    Phase,
    PhaseKind,
    PublicationFact,
    Step,
    Table,
)
from outbox_migrate.patterns.names import Names

PATTERN_NAMES = ("cop", "copra", "hop", "hoper", "hopia")
HEADER = ("acronym", "title", "summary", "pause_publication", "keep_old_rows", "immediate_access")
"""The pattern file's top-level keys a `Pattern` takes as they are."""


@cache
def _raw(name: str) -> Mapping[str, Any]:
    return tomllib.loads(files(__package__).joinpath("catalog", f"{name}.toml").read_text("utf-8"))


def build_pattern(
    name: str,
    spec: OutboxSpec | None = None,
    options: BuildOptions | None = None,
) -> Pattern:
    key = name.lower().strip()
    if key not in PATTERN_NAMES:
        raise UsageError(f"unknown pattern {name!r}; choose one of {', '.join(PATTERN_NAMES)}")
    raw = _raw(key)
    spec = spec or OutboxSpec()
    options = options or BuildOptions()
    names = Names(spec)
    registry = load_all()
    phases: list[Phase] = []
    running = ""
    for raw_phase in raw["phase"]:
        optional = raw_phase.get("optional", False)
        if optional and not options.include_optional:
            # An optional phase (the original name) is left out whole: without it the
            # pattern, its plan and its golden files are exactly what they were.
            continue
        phase_name = raw_phase["name"]
        app = AppBehaviour(
            Table(raw_phase["inserts_into"]),
            Table(raw_phase["publishes_from"]),
            renamed=raw_phase.get("renamed", False),
        )
        shown = app.describe(spec.table, spec.partitioned_table)
        ctx = BuildContext(
            names, key, phase_name, running or f"{phase_name} running: {shown}", options
        )
        built: list[Step] = []
        for entry in raw_phase.get("steps", []):
            params = dict(entry) if isinstance(entry, dict) else {"kind": entry}
            kind_name = params.pop("kind")
            if kind_name not in registry:
                raise ValueError(f"pattern {key}: unknown step kind {kind_name!r}")
            step = registry[kind_name](ctx, params)
            if step is not None:  # a kind that does not apply to this outbox builds no step
                built.append(step)
        if built:
            # The phase's last step that applies tells the operator the next deploy is ready
            # (whether or not it is an optional step left out below).
            built[-1] = replace(built[-1], app_after=f"ready to deploy {phase_name}: {shown}")
        phases.append(
            Phase(
                name=phase_name,
                kind=PhaseKind(raw_phase.get("kind", "deploy")),
                title=raw_phase["title"],
                app=app,
                instructions=tuple(raw_phase.get("instructions", ())),
                steps=tuple(s for s in built if options.include_optional or not s.optional),
                optional=optional,
                unread=(
                    (conditions.no_unread_rows(names, phase_name),)
                    if app.publishes_from is Table.NEW
                    else ()
                ),
            )
        )
        running = f"{phase_name} running: {shown}"
    return Pattern(
        name=key,
        phases=tuple(phases),
        point_of_no_return=raw.get("point_of_no_return", ""),
        **{k: raw[k] for k in HEADER},
    )


def build_from_settings(
    name: str,
    settings: Settings,
    *,
    include_optional: bool = False,
    sample_window_s: float | None = None,
    identity_generation: str = "ALWAYS",
    publications: tuple[PublicationFact, ...] = (),
) -> Pattern:
    """`identity_generation` is the old table's (`ALWAYS` or `BY DEFAULT`, from introspection):
    reversing DROP IDENTITY must restore it as it was."""
    return build_pattern(
        name,
        settings.spec,
        BuildOptions(
            sample_window_s=sample_window_s or settings.gate_window_s,
            old_app_name=settings.old_app_name,
            include_optional=include_optional,
            identity_generation=identity_generation,
            publications=publications,
        ),
    )


__all__ = ["PATTERN_NAMES", "BuildOptions", "build_from_settings", "build_pattern"]
