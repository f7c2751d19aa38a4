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
