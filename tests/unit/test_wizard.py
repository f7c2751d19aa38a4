"""The decision flowchart as a pure function: every outcome, its reasons, and why each other
pattern was not chosen; and how measured facts are explained. No database."""

from __future__ import annotations

import pytest

from outbox_migrate.errors import UsageError
from outbox_migrate.patterns import PATTERN_NAMES
from outbox_migrate.wizard import (
    Answers,
    Measurements,
    interpret,
    needs_immediate_access_question,
    recommend,
)

OUTCOMES = [
    (Answers(pause=True, keep_old_rows=False), "cop"),
    (Answers(pause=True, keep_old_rows=True), "copra"),
    (Answers(pause=False, keep_old_rows=False), "hop"),
    (Answers(pause=False, keep_old_rows=True, immediate_access=False), "hoper"),
    (Answers(pause=False, keep_old_rows=True, immediate_access=True), "hopia"),
]

# What each outcome's reasons must say, and what each rejection must say (by pattern).
REASONS = {
    "cop": ["publication may pause", "nothing is attached"],
    "copra": ["publication may pause", "attached as the DEFAULT", "NOT VALID CHECK"],
    "hop": ["must not pause", "switches to the partitioned table", "nothing is attached"],
    "hoper": ["must not pause", "replaces the published partition", "copies the rows"],
    "hopia": ["must not pause", "trigger copies", "catalog-only swap"],
}
WHY_NOT = {
    "cop": {
        "copra": "attaching the old table is not required",
        "hop": "only for no-pause",
        "hoper": "copy job",
        "hopia": "copy trigger",
    },
    "copra": {
        "cop": "the old rows must join",
        "hop": "only for no-pause",
        "hoper": "copy job",
        "hopia": "copy trigger",
    },
    "hop": {
        "cop": "must not pause",
        "copra": "must not pause",
        "hoper": "old rows need not join",
        "hopia": "old rows need not join",
    },
    "hoper": {
        "cop": "must not pause",
        "copra": "must not pause",
        "hop": "the old rows must join",
        "hopia": "a copy job is simpler than a trigger",
    },
    "hopia": {
        "cop": "must not pause",
        "copra": "must not pause",
        "hop": "the old rows must join",
        "hoper": "missing from the final table until the copy-back job finishes",
    },
}


@pytest.mark.parametrize(("answers", "pattern"), OUTCOMES, ids=[p for _, p in OUTCOMES])
def test_each_outcome_with_its_reasons_and_why_not_the_others(
    answers: Answers, pattern: str
) -> None:
    result = recommend(answers)
    assert result.pattern == pattern
    text = " ".join(result.reasons)
    for phrase in REASONS[pattern]:
        assert phrase in text
    assert set(result.rejected) == set(PATTERN_NAMES) - {pattern}
    for other, phrase in WHY_NOT[pattern].items():
        assert phrase in result.rejected[other], (other, result.rejected[other])
    doc = result.to_json()
    assert doc["pattern"] == pattern and doc["reasons"] == result.reasons


def test_all_five_patterns_are_reachable() -> None:
    assert sorted(recommend(a).pattern for a, _ in OUTCOMES) == sorted(PATTERN_NAMES)


def test_immediate_access_is_asked_only_without_pause_and_with_old_rows() -> None:
    assert needs_immediate_access_question(pause=False, keep_old_rows=True)
    assert not needs_immediate_access_question(pause=True, keep_old_rows=True)
    assert not needs_immediate_access_question(pause=False, keep_old_rows=False)
    assert not needs_immediate_access_question(pause=True, keep_old_rows=False)


@pytest.mark.parametrize("access", [True, False])
def test_immediate_access_does_not_change_a_pausable_or_detached_choice(access: bool) -> None:
    assert recommend(Answers(True, True, access)).pattern == "copra"
    assert recommend(Answers(True, False, access)).pattern == "cop"
    assert recommend(Answers(False, False, access)).pattern == "hop"


def test_missing_third_answer_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--immediate-access or --no-immediate-access"):
        recommend(Answers(pause=False, keep_old_rows=True))


def measurements(**changes: object) -> Measurements:
    values: dict[str, object] = {
        "server_version": "17.2",
        "total_bytes": 3 * 1024**3,
        "heap_bytes": 2 * 1024**3,
        "row_estimate": 12_000_000,
        "unpublished": 42,
        "inserts_per_s": 150.0,
        "publishes_per_s": 149.5,
        "window_s": 2.0,
        "publications": [],
        "foreign_keys_in": [],
        "blockers": [],
    }
    values.update(changes)
    return Measurements(**values)  # type: ignore[arg-type]


def test_notes_state_size_backlog_rates_and_version() -> None:
    first = interpret(measurements(), "hop")[0]
    assert "~12,000,000 rows" in first and "3,072.0 MiB" in first and "42 unpublished" in first
    assert "150.0 inserts/s" in first and "149.5 publishes/s" in first
    assert "over 2 s" in first and "PostgreSQL 17.2" in first


def test_pause_length_is_explained_for_the_cold_patterns_only() -> None:
    for pattern in ("cop", "copra"):
        notes = " ".join(interpret(measurements(), pattern))
        assert "~9,000 messages waiting" in notes  # 150/s for a minute
    for pattern in ("hop", "hoper", "hopia"):
        assert "messages waiting" not in " ".join(interpret(measurements(), pattern))


def test_validate_scan_estimate_for_patterns_that_attach_the_old_table() -> None:
    # 2 GiB heap at 200 MiB/s: about ten seconds, without blocking writers.
    for pattern in ("copra", "hoper", "hopia"):
        notes = " ".join(interpret(measurements(), pattern))
        assert "~10.2 s" in notes and "without blocking writers" in notes
    for pattern in ("cop", "hop"):
        assert "VALIDATE" not in " ".join(interpret(measurements(), pattern))


def test_copy_back_volume_for_hoper() -> None:
    notes = " ".join(interpret(measurements(), "hoper"))
    assert "~538,200 rows per hour" in notes
    assert "copy-back" not in " ".join(interpret(measurements(), "hopia"))


def test_cdc_publications_and_blockers_are_noted() -> None:
    notes = interpret(
        measurements(publications=["cdc_all"], blockers=["fk into outbox: drop it"]), "hop"
    )
    assert any("publications cdc_all" in n and "publish-unpublished-partition" in n for n in notes)
    assert "blocker: fk into outbox: drop it" in notes
    assert not any("CDC" in n for n in interpret(measurements(), "hop"))
