"""Shared test configuration; database fixtures live in tests/fixtures/postgres.py."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """Undo what the generated env.py's `fileConfig(...)` does to this process's logging.

    Alembic's `alembic init` template (the Alembic tests use a fresh one) calls fileConfig
    with disable_existing_loggers=True, which disables every logger that exists at that
    moment — outbox_migrate's among them — and replaces the root handlers. That is the user's choice in their own process; in the test process it
    silenced the relay's logger for every later test (a relay logging test failed only after
    these tests had run).
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    disabled = {
        name: logger.disabled
        for name, logger in root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    try:
        yield
    finally:
        for name, logger in list(root.manager.loggerDict.items()):
            if isinstance(logger, logging.Logger):
                logger.disabled = disabled.get(name, False)
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """Put back SIGINT's and SIGTERM's handlers after each test. A CLI command run in-process
    installs the CLI's handlers and, on its way out, ignores both signals; left in place,
    every later test's subprocess inherited SIGINT ignored (a launcher test that checks the
    handler a fresh interpreter starts with failed whenever it ran after one in its worker)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    unraisable = sys.unraisablehook  # `signals.install` chains its own in front of it
    try:
        yield
    finally:
        sys.unraisablehook = unraisable
        for number, handler in saved.items():
            if handler is not None and signal.getsignal(number) is not handler:
                signal.signal(number, handler)
