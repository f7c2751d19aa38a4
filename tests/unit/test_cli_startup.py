"""`outbox-migrate --help` must stay light: no rich, psycopg or SQLAlchemy on that path."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("rich", "psycopg", "sqlalchemy", "alembic", "psycopg_pool")

PROBE = """
import sys, json
from outbox_migrate.cli.app import main
try:
    main(["--help"])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in %r)), file=sys.stderr)
"""


def test_help_imports_no_heavy_module() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE % (HEAVY,)], capture_output=True, text=True, check=True
    )
    loaded = json.loads(result.stderr.strip().splitlines()[-1])
    assert loaded == [], f"--help imported {loaded}"
    assert "Commands:" in result.stdout


def test_help_lists_every_command_with_an_example() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    import typer.main

    from outbox_migrate.cli.app import app

    group = typer.main.get_command(app)
    names = sorted(group.commands)  # type: ignore[attr-defined]
    assert names, "no commands registered"
    for name in names:
        assert name in result.stdout
        sub = subprocess.run(
            [sys.executable, "-m", "outbox_migrate", name, "--help"],
            capture_output=True,
            text=True,
        )
        assert sub.returncode == 0, sub.stderr
        assert "Example" in sub.stdout, f"{name} --help has no example"


def test_version() -> None:
    from outbox_migrate import __version__

    result = subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0
    assert result.stdout.strip() == f"outbox-migrate {__version__}"


LAUNCH_PROBE = """
import signal, sys, json
before = signal.getsignal(signal.SIGINT)
from outbox_migrate.cli import launch
handled = signal.getsignal(signal.SIGINT) is not before
launch.signals.install()
heavy = %r
print(json.dumps([handled, sorted(m for m in sys.modules if m.split(".")[0] in heavy
                                  or m == "importlib.metadata")]))
"""


def test_the_launcher_imports_nothing_heavy_and_changes_no_handler_on_import() -> None:
    """Handlers go in before typer is imported; importing the launcher (as tests and
    Alembic import CLI modules in-process) does not touch the host's handlers. Compared with
    the handler the interpreter started with, not Python's default: a process started with
    SIGINT ignored (a background job of a non-interactive shell) keeps it ignored."""
    heavy = (*HEAVY, "typer", "click")
    result = subprocess.run(
        [sys.executable, "-c", LAUNCH_PROBE % (heavy,)], capture_output=True, text=True, check=True
    )
    handled, loaded = json.loads(result.stdout)
    assert handled is False
    assert loaded == []


def test_both_entry_points_start_in_the_launcher() -> None:
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["outbox-migrate"] == "outbox_migrate.cli.launch:main"
    main_module = (root / "outbox_migrate" / "__main__.py").read_text()
    assert "from outbox_migrate.cli.launch import main" in main_module
