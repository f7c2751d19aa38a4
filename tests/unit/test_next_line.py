"""The `Next:` line of `run`/`next`: what the operator does at a phase boundary.

Nothing told operators about the REVOKE the switching relay's default gate waits for: V2's
messages then waited silently for it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from outbox_migrate.cli.run_cmd import _what_next
from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import PATTERN_NAMES, build_pattern


def next_line(pattern: str, phase: str) -> str | None:
    result = SimpleNamespace(completed=False, phase=phase, inside=None)
    runner = SimpleNamespace(pattern=build_pattern(pattern), spec=OutboxSpec())
    return _what_next(result, runner)  # type: ignore[arg-type]


@pytest.mark.parametrize("pattern", ["hop", "hoper", "hopia"])
def test_the_switching_phase_names_the_revoke(pattern: str) -> None:
    line = next_line(pattern, "V2")
    assert line is not None
    assert (
        'once V1 is gone, as the owner of outbox: REVOKE INSERT ON "public"."outbox" FROM' in line
    )
    assert line.endswith(f"then `outbox-migrate run --pattern {pattern} --to V3`")


@pytest.mark.parametrize("pattern", PATTERN_NAMES)
def test_no_revoke_where_no_relay_switches(pattern: str) -> None:
    for phase in build_pattern(pattern).phases[1:]:
        if phase.app.publishes_from.value != "old-then-new":
            assert "REVOKE" not in (next_line(pattern, phase.name) or ""), (pattern, phase.name)
