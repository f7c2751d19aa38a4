"""The one way a relay worker waits: never while one of its sessions is in a transaction,
whose locks the migration runner would not queue a step's lock behind (docs/relay.md).
"""

from __future__ import annotations

import logging
import math
import select
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from psycopg import OperationalError, pq

from outbox_migrate.relay.shared import close_quietly
from outbox_migrate.relay.wire import Wire

log = logging.getLogger("outbox_migrate.relay")

PLAIN_SLEEP_MAX_S = 0.05
"""Waits up to this long are a plain sleep (`Event.wait` allocates a lock per call, paid once
per batch by the linger); a stop waits at most this long for them."""

Session = tuple[Any, Wire | None]
_IDLE = pq.TransactionStatus.IDLE
_UNKNOWN = pq.TransactionStatus.UNKNOWN


class WaitInTransaction(RuntimeError):
    """A worker was about to wait with a session inside a transaction: a bug, never retried."""


def check_outside_transaction(sessions: Iterable[Session]) -> None:
    """Raise `WaitInTransaction` if one of `sessions` is, or will stay, in a transaction."""
    for conn, pipe in sessions:
        if conn is None:
            continue
        pg = conn.pgconn
        status = pg.transaction_status
        # UNKNOWN: closed or broken, a session that holds nothing.
        if status in (_IDLE, _UNKNOWN):
            continue
        # In pipeline mode libpq says "active" until results are read.
        if status == pq.TransactionStatus.ACTIVE and pipe is not None and pipe.ends_transactions:
            continue
        raise WaitInTransaction(
            f"relay session pid {pg.backend_pid} would wait in transaction state "
            f"{pq.TransactionStatus(status).name}: end the transaction before waiting"
        )


class Waits:
    def __init__(self, stop: threading.Event, sessions: Callable[[], Iterable[Session]]) -> None:
        self.stop = stop
        self._sessions = sessions

    def check(self) -> None:
        check_outside_transaction(self._sessions())

    def wait(self, seconds: float) -> bool:
        self.check()
        return self.stop.wait(seconds)

    def sleep(self, seconds: float) -> bool:
        """`wait`, as a plain sleep when short (a linger: see PLAIN_SLEEP_MAX_S)."""
        self.check()
        if seconds > PLAIN_SLEEP_MAX_S:
            return self.stop.wait(seconds)
        if seconds > 0:
            time.sleep(seconds)
        return self.stop.is_set()

    def poll(self, poller: select.poll, timeout_ms: int) -> list[tuple[int, int]]:
        self.check()
        return poller.poll(timeout_ms)


_POLL_IN = select.POLLIN | select.POLLERR | select.POLLHUP


class Listener:
    """One worker's LISTEN session, polled by the worker thread itself (a listener thread
    would cost a GIL hand-off per wake-up). Not the claim session: the server notifies a
    session only between its transactions, and a worker sleeps with its COMMIT unread."""

    def __init__(
        self,
        connect: Callable[[], Any],
        channel: str,
        stop_fd: Callable[[], int | None],
        waits: Waits,
        notified: Callable[[list[bytes]], bool],
        index: int,
    ) -> None:
        self._connect = connect
        self._channel = channel
        self._stop_fd = stop_fd
        self._waits = waits
        self._notified = notified
        self._index = index
        self.conn: Any = None
        self._poller: Any = None
        self.blocked = False
        """The last `poll` blocked before it returned (the idle flag's AWAKE_WAITS)."""

    @property
    def listening(self) -> bool:
        return self.conn is not None

    def open(self) -> None:
        from psycopg import sql

        self.close()
        conn = self._connect()
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        except BaseException:
            conn.close()
            raise
        self.conn = conn
        self._poller = select.poll()
        self._poller.register(conn.pgconn.socket, _POLL_IN)
        stop = self._stop_fd()
        if stop is not None:
            self._poller.register(stop, _POLL_IN)

    def close(self) -> None:
        close_quietly(self.conn)
        self.conn, self._poller = None, None

    def take(self) -> bool:
        """Read the notifications libpq holds; True when one calls for a claim (not for rows
        the worker claimed already)."""
        conn = self.conn
        if conn is None:
            return False
        pg = conn.pgconn
        payloads: list[bytes] = []
        while (note := pg.notifies()) is not None:
            payloads.append(note.extra)
        return bool(payloads) and self._notified(payloads)

    def poll(self, timeout_s: float) -> bool:
        """Wait until a notification calls for a claim or a stop (True), or `timeout_s`.
        Reads what already arrived before blocking. A lost session wakes the worker (True)
        and is closed until the next `open`."""
        poller, pg, stop = self._poller, self.conn.pgconn, self._waits.stop
        deadline = time.monotonic() + timeout_s
        ready = True  # a non-blocking read first
        self.blocked = False
        while (left := deadline - time.monotonic()) > 0:
            if not ready:
                self.blocked = True
                if not self._waits.poll(poller, math.ceil(left * 1000)):
                    return False
            ready = False
            if stop.is_set():
                return True
            try:
                pg.consume_input()
                lost = pg.status == pq.ConnStatus.BAD
            except OperationalError:
                lost = True
            if lost:
                # The claim session may hold a COMMIT: wake up, listen again later.
                log.warning("relay.listen_lost worker=%d", self._index)
                self.close()
                return True
            if self.take():
                return True
        return False
