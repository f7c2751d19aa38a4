"""The exit-code table, enforced in one place (`classify`): nothing else in the CLI decides an
exit code (docs/cli.md, "Exit codes"). Imports stay light: no rich, and psycopg only if a
command already loaded it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from outbox_migrate.cli import signals
from outbox_migrate.errors import (
    ConfigError,
    ConnectError,
    ConnectionLost,
    ExitCode,
    OutboxMigrateError,
)

DEBUG_ENV = "OUTBOX_MIGRATE_DEBUG"
# SQLSTATEs that mean "the server went away", besides class 08 (connection exception).
_ADMIN_SHUTDOWN = frozenset({"57P01", "57P02", "57P03"})
_CLOSED_MESSAGES = ("connection is closed", "connection is lost", "server closed the connection",
                    "consuming input failed", "connection to server", "ssl connection has been "
                    "closed", "terminating connection")  # fmt: skip


@dataclass
class _State:
    command: str = "outbox-migrate"
    activity: str | None = None  # what the command is doing now: `step hoper.v2.…`
    note: str | None = None
    outcome: str | None = None  # how the interrupted step ended (`RunnerEvents.interrupted`)
    committed: str | None = None  # the last step this command committed: `step hoper.v2.…`


_state = _State()


def debug_enabled() -> bool:
    value = os.environ.get(DEBUG_ENV, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def set_command(argv: list[str]) -> None:
    """The command's name (`run`, `alembic generate`) for interrupt and lost-connection lines."""
    words = [a for a in argv if not a.startswith("-")]
    name = " ".join(words[:2]) if words[:1] == ["alembic"] else " ".join(words[:1])
    _state.command = name or "outbox-migrate"
    # A new command (tests run several in one process): nothing of the last one's steps.
    _state.activity = _state.note = _state.outcome = _state.committed = None


def set_interrupt_note(note: str) -> None:
    """What an interrupt left behind, when the command knows better than the default
    (`demo`: where its partial report is)."""
    _state.note = note


def doing() -> str:
    command = f"`{_state.command}`"
    return f"{_state.activity} of {command}" if _state.activity else command


_STEP_OUTCOMES = {
    "committed": "{name} after {doing} committed (the ledger records it) — re-run the same "
    "command to continue",
    "unknown": "{name} during {doing} before its outcome reached the command: `outbox-migrate "
    "status` shows whether it committed — re-run the same command to continue",
    "unfinished": "{name} during {doing}; the step did not finish, and it runs outside one "
    "transaction, so the work it did stays — re-run the same command to continue it",
    "rolled-back": "{name} during {doing}; the step did not complete and its transaction was "
    "rolled back — re-run the same command to continue",
}
"""An interrupted step's line, by how it ended (`RunnerEvents.interrupted`)."""


def interrupt_message() -> str:
    name = signals.name()
    if _state.note:
        return f"{name} during {doing()}; {_state.note}"
    if _state.activity and _state.activity.startswith("step "):
        # As the runner read it back from the ledger: an interrupt just after a COMMIT must
        # not be reported as a rollback (docs/cli.md, "An interrupt says what it stopped").
        wording = _STEP_OUTCOMES.get(_state.outcome or "", _STEP_OUTCOMES["rolled-back"])
        return wording.format(name=name, doing=doing())
    if _state.committed:
        return (f"{name} during {doing()} after {_state.committed} committed; nothing was left "
                "half-done — re-run the same command to continue")  # fmt: skip
    return f"{name} during {doing()}; nothing was left half-done — re-run the same command"


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then its cause (or context), and so on; each once, should the chain loop."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def connection_error(exc: BaseException | None) -> BaseException | None:
    """The psycopg error in `exc`'s chain that means the server connection broke, if any:
    SQLSTATE class 08, an administrator/crash shutdown (57P01-57P03), or a client-side
    OperationalError without SQLSTATE (the socket closed under a query)."""
    psycopg = sys.modules.get("psycopg")
    if psycopg is None:
        return None
    return next(
        (e for e in _chain(exc) if isinstance(e, psycopg.Error) and _breaks_connection(e, psycopg)),
        None,
    )


def _interrupt_in_chain(exc: BaseException | None) -> bool:
    """Whether a signal ended the command, even where Python wrapped it: CPython 3.11
    re-raises an exception from `__set_name__` as a RuntimeError caused by it, so a Ctrl-C
    while a lazily imported module builds a class arrives as that RuntimeError."""
    return any(isinstance(e, KeyboardInterrupt) for e in _chain(exc))


def _breaks_connection(exc: Any, psycopg: Any) -> bool:
    state = exc.sqlstate or ""
    if state.startswith("08") or state in _ADMIN_SHUTDOWN:
        return True
    if state:
        return False
    if isinstance(exc, psycopg.OperationalError):
        return True
    lowered = str(exc).lower()
    return isinstance(exc, psycopg.InterfaceError) and any(m in lowered for m in _CLOSED_MESSAGES)


def _first_line(text: str) -> str:
    from outbox_migrate.dsn import mask

    lines = mask(text).strip().splitlines()
    return lines[0] if lines else ""


def classify(exc: BaseException) -> tuple[int, str]:
    if _interrupt_in_chain(exc):
        return signals.exit_code(), interrupt_message()
    if isinstance(exc, ConnectionLost):
        named = f"`{_state.command}`" in exc.doing
        what = exc.doing if named else f"{exc.doing} of `{_state.command}`"
        return int(exc.exit_code), str(ConnectionLost(what, exc.cause))
    if not isinstance(exc, ConnectError | ConfigError):
        lost = connection_error(exc)
        if lost is not None:
            where = getattr(exc, "step_id", None)
            what = f"step {where} of `{_state.command}`" if where else doing()
            cause = _first_line(str(lost)) or type(lost).__name__
            return int(ExitCode.CONNECTION_LOST), str(ConnectionLost(what, cause))
    if isinstance(exc, OutboxMigrateError):
        return int(exc.exit_code), str(exc)
    if getattr(exc, "sqlstate", None) == "42501":  # insufficient_privilege: the wrong role
        return int(ExitCode.USAGE), (
            f"{_first_line(str(exc))}: the role lacks a privilege `{_state.command}` needs"
        )
    message = _first_line(str(exc)) or type(exc).__name__
    return int(ExitCode.FAILED), (f"internal error: {message} (set {DEBUG_ENV}=1 for a traceback)")


class TrackedEvents:
    """Runner events that also record the step in flight, so an interrupt or a lost
    connection names it; everything else is passed on to `inner`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def step_started(self, step: Any, action: str) -> None:
        if action != "already-done":
            _state.activity = f"step {step.id}"
            _state.outcome = None
        self._inner.step_started(step, action)

    def step_finished(self, step: Any, outcome: str, elapsed_s: float) -> None:
        _state.activity = None
        _state.committed = f"step {step.id}"
        self._inner.step_finished(step, outcome, elapsed_s)

    def interrupted(self, step: Any, outcome: str) -> None:
        _state.outcome = outcome

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
