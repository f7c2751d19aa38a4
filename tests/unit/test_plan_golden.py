"""`plan` output, every pattern and every format, against the committed golden files.

A failure means the catalog or a renderer changed what operators read. If the change is
intended, run `python -m tests.golden.regenerate` (or `nox -s regenerate`) and review the diff.
"""

from __future__ import annotations

import difflib
import json
import re

import pytest

from outbox_migrate.patterns import PATTERN_NAMES
from outbox_migrate.plan import split_sql_phases
from tests.golden import regenerate

CASES = regenerate.cases()


def assert_same(name: str, actual: str) -> None:
    expected = (regenerate.PLAN_DIR / name).read_text(encoding="utf-8")
    if actual != expected:
        diff = difflib.unified_diff(
            expected.splitlines(), actual.splitlines(), f"golden/{name}", "now", lineterm=""
        )
        shown = "\n".join(list(diff)[:60])
        pytest.fail(f"plan output differs from tests/golden/plan/{name} "
                    f"(regenerate: python -m tests.golden.regenerate):\n{shown}")  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_output_matches_golden(name: str) -> None:
    assert_same(name, regenerate.run_plan(CASES[name]))


def test_every_pattern_and_format_has_a_golden_file() -> None:
    committed = {p.name for p in regenerate.PLAN_DIR.iterdir()}
    assert committed == set(CASES)
    for pattern in PATTERN_NAMES:
        assert {f"{pattern}.{suffix}" for suffix in regenerate.FORMATS.values()} <= committed


def test_in_process_run_is_what_a_user_sees() -> None:
    """The golden files are rendered in-process for speed; a real process prints the same
    (terminal width, colours and environment included)."""
    for name in ("hoper.txt", "copra.json"):
        assert_same(name, regenerate.run_plan_subprocess(CASES[name]))


def test_environment_does_not_leak_into_the_output(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_MIGRATE_TABLE", "elsewhere")
    monkeypatch.setenv("PGHOST", "db.invalid")
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert_same("cop.txt", regenerate.run_plan(CASES["cop.txt"]))


def test_golden_json_is_the_plan_document() -> None:
    for pattern in PATTERN_NAMES:
        doc = json.loads((regenerate.PLAN_DIR / f"{pattern}.json").read_text(encoding="utf-8"))
        assert doc["pattern"] == pattern
        assert doc["facts"] is None
        ids = [s["id"] for phase in doc["phases"] for s in phase["steps"]]
        assert ids and all(i.startswith(f"{pattern}.") for i in ids)


def test_golden_sql_has_one_section_per_phase_and_wraps_transactions() -> None:
    for pattern in PATTERN_NAMES:
        text = (regenerate.PLAN_DIR / f"{pattern}.sql").read_text(encoding="utf-8")
        doc = json.loads((regenerate.PLAN_DIR / f"{pattern}.json").read_text(encoding="utf-8"))
        phases = split_sql_phases(text)
        assert list(phases) == [p["name"] for p in doc["phases"]]
        lines = text.splitlines()
        transactional = sum(
            1 for p in doc["phases"] for s in p["steps"] if s["transaction"] == "transaction"
        )
        assert lines.count("BEGIN;") == lines.count("COMMIT;") == transactional


def test_custom_names_are_quoted_and_qualified() -> None:
    text = (regenerate.PLAN_DIR / "hopia-custom-names.sql").read_text(encoding="utf-8")
    # Laid out to the terminal's width: compare the statement, not where its lines break.
    statement = re.sub(r"\(\s+", "(", re.sub(r"\s+", " ", text))
    assert 'CREATE TABLE "billing"."events_p" (LIKE "billing"."Events"' in statement
    assert '"billing"."events_done"' in text
    # The relay's dead-letter tables keep the relay's default name (relay --dead-letter-table).
    assert '"public"' not in text and '"outbox' not in text.replace('"outbox_dead_letter', "")
    assert "SET NOT NULL" in text  # --with-optional
