"""The console script's entry point: signal handling first, then the CLI.

`outbox-migrate` (pyproject's `[project.scripts]`) and `python -m outbox_migrate` start
here so that SIGINT/SIGTERM are exceptions the CLI handles before typer, rich or psycopg are
imported — a Ctrl-C at any instant exits 130 (SIGTERM 143) with one line, never a traceback.
This module imports nothing heavy itself; it must stay that way.
"""

from __future__ import annotations

import sys

from outbox_migrate.cli import signals


def main(argv: list[str] | None = None) -> None:
    """Run the CLI in this process as its whole life: `cli.app.main` is the error boundary
    for the command; this covers the moments before it starts and after it has decided the
    exit code (typer still importing, the interpreter shutting down)."""
    signals.install()
    try:
        from outbox_migrate.cli import app

        app.main(argv)
    except KeyboardInterrupt:  # outside app.main's own boundary (importing, or exiting)
        signals.exit_interrupted(_interrupt_message())
    except SystemExit:
        try:  # leaving: a late signal must not raise inside the interpreter's shutdown
            signals.ignore()
        except KeyboardInterrupt:
            signals.exit_interrupted(_interrupt_message())
        raise


def _interrupt_message() -> str:
    exits = sys.modules.get("outbox_migrate.cli.exits")
    if exits is not None:
        return str(exits.interrupt_message())
    return f"{signals.name()} while starting; nothing was done"
