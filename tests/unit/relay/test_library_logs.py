"""Broker libraries' log records become one line each on the relay's logger, with no traceback
fragment — including a traceback a library formats into the message text itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from outbox_migrate.relay import library_logs
from tests.support.log_records import Records


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


def test_a_library_repeating_itself_through_an_outage_is_written_once_per_interval(
    relay_lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RabbitMQ outage of 60 s: pika logs the same four warnings (numbers and addresses
    varying) on each of 109 reconnect attempts — 436 records. Each shape is written at most
    once per REPEAT_INTERVAL_S, the next line counting what was left out. Fails before: 436
    lines (435 were seen in one outage)."""
    now = [0.0]
    monkeypatch.setattr(library_logs._HANDLER, "clock", lambda: now[0])
    pika = logging.getLogger("pika.adapters.utils.connection_workflow")
    blocking = logging.getLogger("pika.adapters.blocking_connection")
    for attempt in range(109):
        now[0] = attempt * 0.55
        port = 40000 + attempt
        pika.error("TCP Connection attempt failed: ConnectionRefusedError(111, 'refused'); "
                   "dest=(2, 1, 6, '', ('127.0.0.1', %d))", port)  # fmt: skip
        pika.error("AMQPConnector - reporting failure: AMQPConnectorSocketConnectError: "
                   "ConnectionRefusedError(111, 'refused')")  # fmt: skip
        pika.error("AMQP connection workflow failed: %s", f"<0x7f{attempt:08x}>")
        blocking.error("Connection workflow failed: AMQPConnectionWorkflowFailed: 1 "
                       "exceptions in all; last exception - ConnectionRefusedError(111)")  # fmt: skip
    # Each shape written at 0 s and at 30.25 s, the second saying 54 were left out before it.
    assert len(relay_lines) == 4 * 2, relay_lines
    assert relay_lines[-1].endswith("(and 54 more like it since the last one)")
    assert sum("pika.adapters.blocking_connection" in line for line in relay_lines) == 2
    library_logs.route()  # a new relay run starts afresh
    blocking.error("Connection workflow failed: again")
    assert relay_lines[-1].endswith("Connection workflow failed: again")


def test_an_error_escaping_a_callback_on_a_sinks_loop_is_one_line(relay_lines: list[str]) -> None:
    """pika's connect workflow raised from a loop callback when a socket was reset under it
    (`getpeername()` failing); asyncio's default handler logged that as an ERROR with the
    traceback, past the routing (CI saw it in test_failures.py). Fails before: the record
    reaches the root logger from `asyncio` and no relay line is written."""
    from outbox_migrate.relay.sinks import event_loop

    def on_writable() -> None:
        raise ValueError("Expected connected socket, but getpeername() failed")

    root, seen = logging.getLogger(), Records()
    root.addHandler(seen)
    loop = event_loop("rabbitmq")
    try:
        loop.call_soon(on_writable)
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
        root.removeHandler(seen)
    assert not [r for r in seen.records if r.name == "asyncio" or r.exc_info], seen.records
    (line,) = relay_lines
    assert line.startswith("relay.sink_library logger=outbox_migrate.relay.sink.rabbitmq ")
    assert line.endswith("ValueError: Expected connected socket, but getpeername() failed")
