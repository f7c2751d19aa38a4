"""SIGINT and SIGTERM as exceptions, installed before anything heavy is imported.

The CLI's entry points (`cli.launch.main`, `python -m outbox_migrate`) call `install()` as
their first statement, so a Ctrl-C while typer, rich or psycopg are still loading ends with
exit 130 and one line, not a traceback. Standard library only, and nothing at import time:
importing this module must not change a host process's handlers (tests and Alembic import
the CLI's modules in-process).
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

INTERRUPTED_EXIT = 130  # errors.ExitCode.INTERRUPTED; not imported, to stay import-free
TERMINATED_EXIT = 143  # errors.ExitCode.TERMINATED


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is so cleanup runs as for Ctrl-C."""


_received: list[int] = []


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    _received.append(signum)
    if signum == signal.SIGTERM:
        raise Terminated()
    raise KeyboardInterrupt()


def install() -> None:
    """SIGINT → KeyboardInterrupt, SIGTERM → Terminated, both remembered for the exit code.

    A second signal while the first unwinds raises again, which is what a user pressing
    Ctrl-C twice expects."""
    _received.clear()
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def last() -> int | None:
    """The last signal received since `install()`, if any."""
    return _received[-1] if _received else None


def exit_code() -> int:
    return TERMINATED_EXIT if last() == signal.SIGTERM else INTERRUPTED_EXIT


def name() -> str:
    """How the last signal is named in the one-line message."""
    return "terminated (SIGTERM)" if last() == signal.SIGTERM else "interrupted"


def ignore() -> None:
    """Ignore SIGINT and SIGTERM from now on: the process is leaving with its exit code
    decided, and a late signal must not raise inside the interpreter's shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def exit_interrupted(message: str) -> None:
    """Leave at once with the signal's exit code and one line: used where the CLI's error
    boundary (`cli.app.main`) is not running yet or has already returned. Further signals are
    ignored: a second Ctrl-C must not turn the exit into a traceback."""
    ignore()
    sys.stderr.write(f"outbox-migrate: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(exit_code())
