"""Broker libraries' log records as one-line `relay.sink_library` events (docs/relay.md,
"Metrics, health and log events"): the relay reports each broker failure itself, so errors
and warnings become warnings, the rest debug lines, and a traceback only its last line.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

from outbox_migrate.relay.sinks.urls import mask_url

LIBRARY_LOGGERS = (
    "pika", "nats", "aiormq", "aio_pika", "redis", "httpx", "httpcore",
    "outbox_migrate.relay.sink",  # what sinks get through library callbacks
)  # fmt: skip
EVENT = "relay.sink_library"
MAX_LINE_CHARS = 500
REPEAT_INTERVAL_S = 30.0
MAX_SHAPES = 1_000
"""Shapes remembered at most (a library that puts unique text in every line)."""
_VARIABLE = re.compile(r"0x[0-9a-fA-F]+|\d+")
_EMBEDDED_TRACEBACK = re.compile(
    r"(?:\s*Caller's stack:)?\s*(?:Traceback|Stack) \(most recent call last\):.*", re.DOTALL
)
_relay_log = logging.getLogger("outbox_migrate.relay")


class _OneLine(logging.Handler):
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.clock = clock
        self._guard = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}
        """Shape → when last written, how many left out since."""

    def reset(self) -> None:
        with self._guard:
            self._seen.clear()

    def _left_out(self, name: str, text: str) -> int | None:
        """None: leave this line out; else how many of its shape were left out before it."""
        key = (name, _VARIABLE.sub("#", text))
        now = self.clock()
        with self._guard:
            last = self._seen.get(key)
            if last is not None and now - last[0] < REPEAT_INTERVAL_S:
                self._seen[key] = (last[0], last[1] + 1)
                return None
            if len(self._seen) >= MAX_SHAPES:
                self._seen.clear()
            self._seen[key] = (now, 0)
            return last[1] if last is not None else 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a library's bad format string must not kill us
            text = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            text = f"{text}: {type(exc).__name__}: {exc}"
        text = mask_url(" ".join(_without_traceback(text).split()))[:MAX_LINE_CHARS]
        level = logging.WARNING if record.levelno >= logging.WARNING else logging.DEBUG
        if not _relay_log.isEnabledFor(level):
            return
        if level == logging.WARNING:
            left_out = self._left_out(record.name, text)
            if left_out is None:
                return
            if left_out:
                text += f" (and {left_out} more like it since the last one)"
        _relay_log.log(level, "%s logger=%s %s", EVENT, record.name, text)


def _without_traceback(text: str) -> str:
    """A traceback formatted into the text (as pika does) replaced by its last line."""
    found = _EMBEDDED_TRACEBACK.search(text)
    if found is None:
        return text
    lines = [line for line in found.group(0).splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    if last.startswith(("File ", "Traceback", "Stack")):  # cut short: no exception line
        last = ""
    head = text[: found.start()].rstrip(" :.")
    return f"{head}: {last}" if last else head


_HANDLER = _OneLine()


def route() -> None:
    """Install the routing (idempotent) and forget the repeats seen so far."""
    _HANDLER.reset()
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if _HANDLER not in logger.handlers:
            logger.addHandler(_HANDLER)
        logger.propagate = False
