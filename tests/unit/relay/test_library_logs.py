"""Broker libraries' log records become one line each on the relay's logger, with no traceback
fragment — including a traceback a library formats into the message text itself."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from outbox_migrate.relay import library_logs


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def relay_lines() -> Iterator[list[str]]:
    library_logs.route()
    relay = logging.getLogger("outbox_migrate.relay")
    handler, level = Collect(), relay.level
    relay.addHandler(handler)
    relay.setLevel(logging.DEBUG)
    try:
        yield handler.lines
    finally:
        relay.removeHandler(handler)
        relay.setLevel(level)


def test_pika_callers_stack_is_reduced_to_the_exception_line(relay_lines: list[str]) -> None:
    """pika's own decorator logs "Caller's stack:" and the whole traceback in the message."""
    pytest.importorskip("pika")
    from pika.diagnostic_utils import create_log_exception_decorator

    log_exceptions = create_log_exception_decorator(logging.getLogger("pika.adapters.test"))

    @log_exceptions
    def on_readable() -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(ConnectionResetError):
        on_readable()
    (line,) = relay_lines
    assert line.startswith("relay.sink_library logger=pika.adapters.test Wrapped func exited")
    assert line.endswith("ConnectionResetError: [Errno 104] Connection reset by peer")
    for fragment in ("Traceback", "Caller's stack", 'File "', "\n"):
        assert fragment not in line, line


def test_a_plain_line_is_unchanged(relay_lines: list[str]) -> None:
    logging.getLogger("nats.test").warning("connection %s lost", "nats://u:secret@h:4222")
    assert relay_lines == [
        "relay.sink_library logger=nats.test connection nats://u:****@h:4222 lost"
    ]
