"""SIGINT and SIGTERM handling, in place before anything heavy is imported (docs/cli.md, "Exit
codes"). Importing this module changes no handler: tests and Alembic import the CLI in-process."""

from __future__ import annotations

# The C module: `signal` imports enum, time in which Python's default handler would still
# turn a Ctrl-C into a traceback.
import _signal  # type: ignore[import-not-found]
import os  # loaded by the interpreter before any program: free
import sys

TYPE_CHECKING = False  # not typing's: importing typing would delay the handlers
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType
    from typing import Any

SIGINT: int = _signal.SIGINT
SIGTERM: int = _signal.SIGTERM
INTERRUPTED_EXIT = 130  # errors.ExitCode.INTERRUPTED; not imported, to stay import-free
TERMINATED_EXIT = 143  # errors.ExitCode.TERMINATED


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is so cleanup runs as for Ctrl-C."""


_received: list[int] = []
_raising = [True]
"""False while `defer()` is in force: the handler records and returns."""
_swallowed: list[int] = []
"""Signals whose exception Python dropped (`_unraisable`): the command went on regardless."""
_chained = [sys.unraisablehook]
"""The hook `_unraisable` hands everything else to: the one in place when `install` ran."""


def _unraisable(hook_args: Any) -> None:
    """An interrupt raised where Python ignores exceptions (a module lock's weakref callback,
    while a command imports lazily) is dropped with an "Exception ignored" traceback, and the
    command goes on. Recorded instead, without the traceback: the CLI then exits as the
    signal (`swallowed`), whatever the command did after it."""
    if isinstance(hook_args.exc_value, KeyboardInterrupt) and _received:
        _swallowed.append(_received[-1])
        return
    _chained[0](hook_args)


def swallowed() -> bool:
    return bool(_swallowed)


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    _received.append(signum)
    if _raising[0]:
        _raise(signum)


def _raise(signum: int) -> None:
    if signum == SIGTERM:
        raise Terminated()
    raise KeyboardInterrupt()


def _handle(handler: Any) -> None:
    _signal.signal(SIGINT, handler)
    _signal.signal(SIGTERM, handler)


def defer() -> None:
    """Record SIGINT/SIGTERM without raising, while the CLI's modules load: an exception
    raised mid-import can land where Python ignores it (a module lock's weakref callback) or
    leave a module half built. The first thing a CLI process does."""
    _raising[0] = False
    _received.clear()
    _handle(_on_signal)


def install() -> None:
    """SIGINT → KeyboardInterrupt, SIGTERM → Terminated, both remembered for the exit code;
    a signal recorded under `defer()` is raised now.

    A second signal while the first unwinds raises again, which is what a user pressing
    Ctrl-C twice expects."""
    pending = None if _raising[0] else last()
    if _raising[0]:
        _received.clear()  # a new command in this process (tests call the CLI in-process)
    _swallowed.clear()
    _raising[0] = True
    if sys.unraisablehook is not _unraisable:
        _chained[0], sys.unraisablehook = sys.unraisablehook, _unraisable
    _handle(_on_signal)
    if pending is not None:
        _raise(pending)


def last() -> int | None:
    return _received[-1] if _received else None


def exit_code() -> int:
    return TERMINATED_EXIT if last() == SIGTERM else INTERRUPTED_EXIT


def name() -> str:
    return "terminated (SIGTERM)" if last() == SIGTERM else "interrupted"


def ignore() -> None:
    """Ignore SIGINT and SIGTERM from now on: the process is leaving with its exit code
    decided, and a late signal must not raise inside the interpreter's shutdown."""
    _handle(_signal.SIG_IGN)


def say_interrupted(message: str) -> int:
    """Ignore further signals, write the one line, and return the exit code to leave with:
    for the moments the CLI's error boundary (`cli.app.main`) is not running."""
    ignore()
    sys.stderr.write(f"outbox-migrate: error: {message}\n")
    sys.stderr.flush()
    return exit_code()


class GracefulStop:
    """A service's stop (`relay`, `maintain` in loop mode; docs/cli.md, "Exit codes"): from
    the command's first statement on, SIGTERM and SIGINT call the service's `stop` once there
    is one (`attach`) and are remembered until then."""

    def __init__(self) -> None:
        self.requested = False
        self._wake_fd: int | None = None
        _handle(self._on_signal)

    def _on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        # Only a write to a pipe here: the handler runs on the main thread between two
        # bytecodes, maybe while that thread holds a lock the stop takes (an Event's), so
        # the stop itself runs on a thread of its own (`attach`).
        self.requested = True
        _received.append(_signum)  # the exit code of a stop that is not the service's normal end
        if self._wake_fd is not None:
            try:
                os.write(self._wake_fd, b"x")
            except OSError:  # the pipe is full: a stop is on its way already
                return

    def attach(self, stop: Callable[[], None]) -> bool:
        """From now on a signal calls `stop` (on a thread of its own); True when one came
        already (do not start)."""
        import threading

        read_fd, self._wake_fd = os.pipe()
        os.set_blocking(self._wake_fd, False)

        def stop_on_signal() -> None:
            while os.read(read_fd, 1):
                stop()

        threading.Thread(target=stop_on_signal, name="om-graceful-stop", daemon=True).start()
        return self.requested
