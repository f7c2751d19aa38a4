"""A production install has no proof harness (harness/, its own distribution): `demo` then
says how to get it in one line and exits 2, and no other missing module is blamed on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from outbox_migrate.errors import UsageError, harness_missing

ROOT = Path(__file__).resolve().parents[2]

WITHOUT_HARNESS = """
import sys
sys.modules["outbox_migrate_harness"] = None  # as if not installed
sys.argv = ["outbox-migrate", "demo", "--pattern", "hoper", "--dsn", "postgresql://nowhere/x"]
from outbox_migrate.cli.launch import main
main()
"""


def test_demo_without_the_harness_says_how_to_install_it_and_exits_2() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_HARNESS], capture_output=True, text=True, env=env,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "demo needs the proof harness" in lines[0]
    assert "pip install 'outbox-migrate[demo]'" in lines[0]


def test_another_missing_module_is_not_blamed_on_the_harness() -> None:
    assert isinstance(
        harness_missing("demo", ModuleNotFoundError(name="outbox_migrate_harness.sim")), UsageError
    )
    other = ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    with pytest.raises(ModuleNotFoundError) as raised:
        harness_missing("demo", other)
    assert raised.value is other
