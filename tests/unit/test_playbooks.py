"""The committed playbooks are exactly what the catalog generates, and they cover every step.

A failure after a catalog change: run `python -m tests.golden.regenerate` and commit the
playbooks with the change.
"""

from __future__ import annotations

import difflib

import pytest

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import PATTERN_NAMES, BuildOptions, build_pattern
from outbox_migrate.playbook import render_playbook
from tests.golden.regenerate import PLAYBOOK_DIR


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_committed_playbook_is_generated_from_the_catalog(name: str) -> None:
    committed = (PLAYBOOK_DIR / f"{name}.md").read_text(encoding="utf-8")
    generated = render_playbook(name)
    if committed != generated:
        diff = difflib.unified_diff(
            committed.splitlines(), generated.splitlines(), f"playbooks/{name}.md", "catalog",
            lineterm="",
        )  # fmt: skip
        pytest.fail(
            f"playbooks/{name}.md is stale (python -m tests.golden.regenerate):\n"
            + "\n".join(list(diff)[:60])
        )


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_playbook_lists_every_step_with_its_sql_and_back_out(name: str) -> None:
    text = render_playbook(name)
    pattern = build_pattern(name, OutboxSpec(), BuildOptions(include_optional=True))
    for phase in pattern.phases:
        assert f"{phase.name} ({phase.kind.value}): {phase.title}" in text
        for instruction in phase.instructions:
            assert instruction in text
    for step in pattern.steps():
        assert f"`{step.id}`" in text
        for statement in step.sql_texts():
            assert statement in text
        for reverse in step.reverse or ():
            assert reverse.as_string(None) in text
    if pattern.point_of_no_return:
        assert f"Point of no return: `{pattern.point_of_no_return}`" in text
        assert "Back out: **no**" in text
    else:
        assert "No point of no return" in text
        assert "Back out: **no**" not in text


def test_playbook_warns_when_rolling_back_strands_new_messages() -> None:
    """Going back to a version that does not publish from the new table leaves the messages
    written there unpublished; going back to HOP's switching V2 does not."""
    cop = render_playbook("cop")
    assert "the application can go back to V1" in cop
    assert "messages V2 inserted into `outbox_new` are not published" in cop
    assert "messages V3 inserted into `outbox_new` are not published" in cop
    hop = render_playbook("hop")
    assert "messages V2 inserted into `outbox_new` are not published" in hop
    assert "messages V3 inserted" not in hop


def test_playbook_follows_the_names_it_is_given() -> None:
    spec = OutboxSpec(schema="billing", table="events", partitioned_table="events_p")
    text = render_playbook("copra", spec)
    assert 'ALTER TABLE "billing"."events_p" ATTACH PARTITION "billing"."events" DEFAULT' in text
    assert '"public"' not in text


def test_patterns_that_copy_whole_rows_warn_about_generated_columns() -> None:
    for name in PATTERN_NAMES:
        warned = "must have no generated column" in render_playbook(name)
        assert warned is (name in ("hoper", "hopia")), name


@pytest.mark.parametrize("name", ["hop", "hoper", "hopia"])
def test_switching_playbooks_name_the_revoke_the_gate_waits_for(name: str) -> None:
    """The switching relay's default gate waits for a REVOKE that no runbook mentioned."""
    text = render_playbook(name)
    assert "REVOKE INSERT ON the old table FROM the application's role" in text
    assert "A REVOKE does not stop a superuser or the table's owner" in text


def test_the_runbooks_say_what_plan_blocks_on_as_plan_judges_it() -> None:
    """The "what plan says" table is judged by `introspect.judge` when the runbook is
    rendered: a flag marker and a serial id are not blockers, a table that deletes what it
    delivers is, and HOPER alone blocks on a missing unique id index."""
    for name in ("hop", "hoper"):
        text = render_playbook(name)
        assert (
            "| a flag as the marker: `published smallint NOT NULL DEFAULT 0` | not a blocker"
            in text
        )
        assert (
            "| `bigserial` id, `published_at timestamptz` NULL until sent | not a blocker" in text
        )
        assert "| rows deleted on delivery (1,000 inserted, 1,000 deleted, none updated) | " \
            "**blocker**: `delete-on-delivery` |" in text  # fmt: skip
        unique = "| no unique index on the id | **blocker**: `no-unique-id` |" in text
        assert unique == (name == "hoper")
