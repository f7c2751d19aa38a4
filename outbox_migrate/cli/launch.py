"""The console script's entry point: signal handling first, then the CLI (`cli.app`). It imports
nothing heavy itself, so a Ctrl-C at any instant of the program's own code exits 130 (SIGTERM
143) with one line; it must stay that way."""

from __future__ import annotations

import sys

from outbox_migrate.cli import signals


def main(argv: list[str] | None = None) -> None:
    """Run the CLI in this process as its whole life: `cli.app.main` is the error boundary
    for the command; this covers the moments before it starts and after it has decided the
    exit code (the CLI's modules still loading, the interpreter shutting down)."""
    signals.defer()
    code: int | str | None
    try:
        from outbox_migrate.cli import app

        signals.install()  # raises here a signal that came while the modules loaded
        app.main(argv)
        code = 0
    except KeyboardInterrupt:  # outside app.main's own boundary (loading, or exiting)
        code = signals.say_interrupted(_interrupt_message())
    except SystemExit as leaving:
        code = leaving.code
    try:  # leaving: a late signal must not raise inside the interpreter's shutdown
        signals.ignore()
    except KeyboardInterrupt:
        code = signals.say_interrupted(_interrupt_message())
    if code in (signals.INTERRUPTED_EXIT, signals.TERMINATED_EXIT):
        _leave_at_once(int(code))
    sys.exit(code)


def _leave_at_once(code: int) -> None:
    """Exit functions run and streams flushed, the interpreter's slow teardown skipped (every
    `with` block has unwound already). It also keeps CPython from re-raising SIGINT at exit
    after a KeyboardInterrupt went through an `exec()` (exit status -2 instead of 130)."""
    import atexit
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _interrupt_message() -> str:
    exits = sys.modules.get("outbox_migrate.cli.exits")
    if exits is not None and signals.last() is not None:
        return str(exits.interrupt_message())
    return f"{signals.name()} while starting; nothing was done"
