"""The pattern catalog: COP, COPRA, HOP, HOPER and HOPIA as data (`catalog/*.toml`).

A pattern file lists phases (deploys V1..V4 and jobs) and, per phase, step kinds by name;
`build_pattern` turns it into concrete, inert `Step`s for one `OutboxSpec`. A sixth pattern
is a new TOML file (plus a test), not new code.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

from outbox_migrate.config import OutboxSpec, Settings
from outbox_migrate.errors import UsageError
from outbox_migrate.patterns import conditions
from outbox_migrate.patterns.kinds import BuildContext, load_all
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
DEFAULT_SAMPLE_WINDOW_S = 2.0
"""How long a deploy gate watches the old table's sequence for new ids."""


@dataclass(frozen=True)
class BuildOptions:
    """Choices that change the concrete steps (and so their checksums)."""

    sample_window_s: float = DEFAULT_SAMPLE_WINDOW_S
    old_app_name: str = ""
    include_optional: bool = False
    identity_generation: str = "ALWAYS"
    publications: tuple[PublicationFact, ...] = ()
    """Publications covering the old table: a conditional step carries them (CDC users)."""


@cache
def _raw(name: str) -> Mapping[str, Any]:
    try:
        text = files(__package__).joinpath("catalog", f"{name}.toml").read_text("utf-8")
    except FileNotFoundError:
        raise UsageError(
            f"unknown pattern {name!r}; choose one of {', '.join(PATTERN_NAMES)}"
        ) from None
    return tomllib.loads(text)


def build_pattern(
    name: str,
    spec: OutboxSpec | None = None,
    options: BuildOptions | None = None,
) -> Pattern:
    """The named pattern with every step built for `spec`."""
    key = name.lower().strip()
    if key not in PATTERN_NAMES:
        raise UsageError(f"unknown pattern {name!r}; choose one of {', '.join(PATTERN_NAMES)}")
    raw = _raw(key)
    spec = spec or OutboxSpec()
    options = options or BuildOptions()
    names = Names(spec)
    registry = load_all()
    phases: list[Phase] = []
    previous: AppBehaviour | None = None
    previous_name = ""
    for raw_phase in raw["phase"]:
        if raw_phase.get("optional", False) and not options.include_optional:
            # An optional phase (the original name) is left out whole: without it the
            # pattern, its plan and its golden files are exactly what they were.
            continue
        app = AppBehaviour(
            Table(raw_phase["inserts_into"]),
            Table(raw_phase["publishes_from"]),
            renamed=raw_phase.get("renamed", False),
        )
        running = previous or app
        running_name = previous_name or raw_phase["name"]
        running_text = running.describe(spec.table, spec.partitioned_table)
        describe_running = f"{running_name} running: {running_text}"
        entries = [e if isinstance(e, dict) else {"kind": e} for e in raw_phase.get("steps", [])]
        steps: list[Step] = []
        # A kind that does not apply to this outbox builds no step; the phase's last step is
        # the last one that applies (it tells the operator the next deploy is ready).
        final = max(
            (
                i
                for i, e in enumerate(entries)
                if _applies(registry, key, raw_phase, e, names, options)
            ),
            default=-1,
        )
        for index, entry in enumerate(entries):
            last = index == final
            after = (
                f"ready to deploy {raw_phase['name']}: "
                f"{app.describe(spec.table, spec.partitioned_table)}"
                if last
                else describe_running
            )
            ctx = BuildContext(
                names=names,
                pattern=key,
                phase=raw_phase["name"],
                app_before=describe_running,
                app_after=after,
                sample_window_s=options.sample_window_s,
                old_app_name=options.old_app_name,
                identity_generation=options.identity_generation,
                publications=options.publications,
            )
            kind_name = entry["kind"]
            if kind_name not in registry:
                raise ValueError(f"pattern {key}: unknown step kind {kind_name!r}")
            params = {k: v for k, v in entry.items() if k != "kind"}
            step = registry[kind_name](ctx, params)
            if step is None or (step.optional and not options.include_optional):
                continue
            steps.append(step)
        phases.append(
            Phase(
                name=raw_phase["name"],
                kind=PhaseKind(raw_phase.get("kind", "deploy")),
                title=raw_phase["title"],
                app=app,
                instructions=tuple(raw_phase.get("instructions", ())),
                steps=tuple(steps),
                optional=raw_phase.get("optional", False),
                unread=(
                    (conditions.no_unread_rows(names, raw_phase["name"]),)
                    if app.publishes_from is Table.NEW
                    else ()
                ),
            )
        )
        previous, previous_name = app, raw_phase["name"]
    return Pattern(
        name=key,
        acronym=raw["acronym"],
        title=raw["title"],
        summary=raw["summary"],
        pause_publication=raw["pause_publication"],
        keep_old_rows=raw["keep_old_rows"],
        immediate_access=raw["immediate_access"],
        phases=tuple(phases),
        point_of_no_return=raw.get("point_of_no_return", ""),
    )


def _applies(
    registry: Mapping[str, Any],
    pattern: str,
    raw_phase: Mapping[str, Any],
    entry: Mapping[str, Any],
    names: Names,
    options: BuildOptions,
) -> bool:
    """Whether the entry's kind builds a step for this outbox (kinds are pure and cheap)."""
    builder = registry.get(entry["kind"])
    if builder is None:
        return True  # reported by the build itself
    probe = BuildContext(names=names, pattern=pattern, phase=raw_phase["name"], app_before="",
                         app_after="", sample_window_s=DEFAULT_SAMPLE_WINDOW_S,
                         old_app_name="", publications=options.publications)  # fmt: skip
    return builder(probe, {k: v for k, v in entry.items() if k != "kind"}) is not None


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
