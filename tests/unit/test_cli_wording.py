"""People-facing lines: plurals that agree ("ran 1 step"), and `status` naming a step once
(its footer printed "hoper.v4.swap-default: hoper.v4.swap-default: could not take …")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from outbox_migrate.cli import console, run_cmd
from outbox_migrate.cli.options import OutputFormat
from outbox_migrate.cli.wording import count


@pytest.fixture
def narrow(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("COLUMNS", "80")
    console.out.cache_clear()
    yield
    console.out.cache_clear()


def test_count_agrees_with_its_number() -> None:
    assert count(1, "step") == "1 step"
    assert count(0, "step") == "0 steps"
    assert count(2, "batch", "batches") == "2 batches"
    assert count(1200, "row") == "1,200 rows"


@dataclass
class _Result:
    pattern: str = "hoper"
    ran: list[str] = field(default_factory=lambda: ["hoper.v3.gate-old-table-retired"])
    adopted: list[str] = field(default_factory=list)
    completed: bool = False
    phase: str = "V3"


def test_run_says_1_step(narrow: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run_cmd._report(_Result(), OutputFormat.text)
    printed = capsys.readouterr().out
    assert "ran 1 step," in printed and "1 steps" not in printed


def test_status_names_the_step_once_in_its_footer(
    narrow: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    step = "hoper.v4.swap-default"
    error = f"{step}: could not take its locks in 3 attempts over 1.0 s; nothing was applied"
    console.render_status({
        "pattern": "hoper", "table": "public.outbox", "state": "active", "phase": "V3",
        "next_phase": "V4",
        "steps": [{"id": step, "state": "failed", "attempts": 3, "duration_ms": None,
                   "lock_wait_ms": 1000.0, "last_error": error}],
    })  # fmt: skip
    printed = capsys.readouterr().out
    assert f"{step}: {step}" not in printed
    assert printed.count(step) == 2  # the table's row and the footer's line
    assert "could not take its locks" in printed


def test_a_long_command_splits_where_the_shell_joins_it() -> None:
    import shlex

    from outbox_migrate.cli.wording import command_lines, wrap_text

    command = (
        "outbox-migrate plan --pattern hop --schema billing --table event_outbox "
        "--dsn 'host=db.example.com user=app password=**** dbname=app' --with-optional"
    )
    lines = command_lines(command, 72)
    assert len(lines) > 1 and all(len(line) <= 72 for line in lines)
    assert all(line.endswith(" \\") for line in lines[:-1])
    rejoined = " ".join(line.removesuffix("\\").strip() for line in lines)
    assert shlex.split(rejoined) == shlex.split(command)
    wrapped = wrap_text("  - " + "hoper.v2.create-partitioned-table " * 4, 40)
    assert all(line.startswith("    ") for line in wrapped[1:])
    assert all("hoper.v2.create-partitioned-table" in line for line in wrapped)


def test_the_lock_budget_error_says_1_attempt() -> None:
    from outbox_migrate.errors import LockBudgetExceeded

    assert "in 1 attempt over 1.0 s" in str(LockBudgetExceeded("s.v4.swap", 1, 1.0, []))
    assert "in 3 attempts over" in str(LockBudgetExceeded("s.v4.swap", 3, 1.0, []))


def test_every_help_example_is_laid_out_to_paste_without_a_cut_word() -> None:
    """click wrapped `Example:` like prose and broke `--no-immediate-access` at its hyphen:
    pasted, the second line ran `access --format json` as a command of its own (and `plan`'s
    ran `sql > hoper.sql`). Each line now fits 80 columns and all but the last end in ` \\`."""
    import shlex

    from tests.support.help_examples import example_blocks, pasted, rendered_helps

    seen = 0
    for path, text in rendered_helps():
        for lines in example_blocks(text):
            seen += 1
            assert all(len(line) <= 80 for line in lines), (path, lines)
            assert all(line.endswith(" \\") for line in lines[:-1]), (path, lines)
            words = shlex.split(pasted(lines))
            assert words[0] == "outbox-migrate", (path, lines)
            assert not [w for w in words if w.endswith("-") and w.strip("-")], (path, lines)
    assert seen >= 20  # every command has one
