"""What the workers of one polling relay share: the one way they reach it, so a worker never
sees the `Relay` itself (no import circle).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox_migrate.relay import keepalive, queries
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.metrics import Observer
from outbox_migrate.relay.options import Mode, RelayOptions
from outbox_migrate.relay.refusals import Refusals
from outbox_migrate.relay.run_stats import RelayStats
from outbox_migrate.relay.sinks import Sink, SinkFactory
from outbox_migrate.relay.switching import SourceState

log = logging.getLogger("outbox_migrate.relay")


@dataclass(eq=False)
class Shared:
    dsn: str
    application_name: str
    options: RelayOptions
    state: SourceState
    stats: RelayStats
    observer: Observer
    sink_factory: SinkFactory
    refusals: Refusals
    text_ids: bool
    message: type[Message]
    stopped: threading.Event
    request_stop: Callable[[], None]
    """`Relay.stop`: sets `stopped` and wakes idle workers through the stop pipe."""
    wake_fd: Callable[[], int | None]
    columns: dict[str, queries.Columns] = field(default_factory=dict)
    conns: dict[int, Any] = field(default_factory=dict)
    """Every worker session by key, cancelled at the shutdown timeout."""
    abandon: threading.Event = field(default_factory=threading.Event)
    """Set after the shutdown timeout: in-flight batches roll back before their mark."""
    fatal: BaseException | None = None

    @property
    def stopping(self) -> bool:
        return self.stopped.is_set()

    def fail(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        self.request_stop()

    def nothing_left(self, conn: Any) -> bool:
        """`until_empty`: this worker's table is empty; in switching mode, wait for the switch
        unless the partitioned table is empty too (nothing to publish either way)."""
        if self.state.mode is not Mode.switching or self.state.switched:
            return True
        row = conn.execute(queries.has_unpublished(self.state.partitioned)).fetchone()
        return not (row and row[0])

    def connect_worker(self) -> Any:
        from outbox_migrate.db import connect

        return connect(
            self.dsn,
            application_name=self.application_name,
            params=keepalive.libpq_params(self.options.dead_session_s),
        )

    def close_conn(self, key: int, conn: Any) -> None:
        self.conns.pop(key, None)
        close_quietly(conn)


def close_quietly(thing: Any, event: str = "relay.close_failed") -> None:
    """Close a connection or sink; a broken one may fail to close too, and is replaced."""
    if thing is not None:
        try:
            thing.close()
        except Exception:
            log.debug(event, exc_info=True)


def close_sink(sink: Sink | None) -> None:
    close_quietly(sink, "relay.sink_close_failed")


def connection_errors(*more: type[BaseException]) -> tuple[type[BaseException], ...]:
    import psycopg

    return (psycopg.OperationalError, psycopg.InterfaceError, *more)
