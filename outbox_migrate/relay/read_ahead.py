"""A worker's second session, which claims the next batch while the one in hand is published
(docs/relay.md, "Read-ahead"). It only ever runs a plain range claim ahead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from psycopg import pq

from outbox_migrate.relay import keepalive, queries, wire
from outbox_migrate.relay.shared import close_quietly

log = logging.getLogger("outbox_migrate.relay")


@dataclass
class Pending:
    pipe: wire.Wire
    conn: Any
    slot: wire.Slot
    after: int
    sent: float


class ReadAhead:
    """Opened at its first use, closed on any error."""

    def __init__(self, open_session: Callable[[], Any]) -> None:
        self._open_session = open_session
        self.conn: Any = None
        self.pipe: wire.Wire | None = None

    def session(self, statements: Iterable[bytes]) -> tuple[Any, wire.Wire]:
        if self.conn is None or self.conn.closed or self.pipe is None:
            self.close()
            conn = self._open_session()
            self.conn, self.pipe = conn, wire.Wire(conn)
        pipe = self.pipe
        for statement in statements:
            pipe.prepare(statement)
        return self.conn, pipe

    def send(
        self, pipe: wire.Wire, conn: Any, claim: bytes, params: dict[str, Any], after: int
    ) -> Pending:
        sent = time.monotonic()
        pipe.send_plain(b"BEGIN")
        slot = pipe.send(claim, {**params, "after": after})
        pipe.send_sync()
        return Pending(pipe, conn, slot, after, sent)

    @staticmethod
    def receive(pending: Pending) -> list[tuple[Any, ...]]:
        pending.pipe.sync()
        return pending.pipe.rows(pending.slot)

    def settle(self) -> None:
        pipe = self.pipe
        if pipe is None:
            return
        try:
            pipe.pause()  # reads everything in flight, then leaves pipeline mode
        except BaseException:
            self.close()
            raise

    def abandon(self) -> None:
        """After a failure: read what is in flight (a COMMIT that went through is counted),
        roll back a batch claimed ahead; any error here closes the session instead."""
        pipe, conn = self.pipe, self.conn
        if pipe is None or conn is None:
            return
        if pipe.pg.status != pq.ConnStatus.OK:
            self.close()
            return
        try:
            pipe.pause()  # reads everything in flight, then leaves pipeline mode
            if conn.info.transaction_status != pq.TransactionStatus.IDLE:
                conn.execute(b"ROLLBACK")
        except Exception:  # this session failed too: the server rolls it back when closed
            log.debug("relay.read_ahead_abandon_failed", exc_info=True)
            self.close()

    def close(self) -> None:
        close_quietly(self.conn, "relay.read_ahead_close_failed")
        self.conn, self.pipe = None, None


def open_session(
    connect: Callable[[], Any], timeout_s: float, poll_interval_s: float
) -> Callable[[], Any]:
    """Open a read-ahead session like the lease session, without the idle-session timeout:
    it holds no shard lock."""

    def opened() -> Any:
        conn = connect()
        try:
            keepalive.configure_session(conn, timeout_s, poll_interval_s, idle_session=False)
            conn.execute(queries.claim_session_settings())
            conn.prepare_threshold = None  # see the worker: psycopg's DEALLOCATE ALL
        except BaseException:
            conn.close()
            raise
        return conn

    return opened
