"""The one way a relay worker waits: never while one of its sessions is in a transaction.

A session waiting inside its transaction holds the claimed rows' locks, and the migration
runner does not queue a step's lock behind it (lock_budget.py): under steady traffic a step
would never find its moment. So every wait of a worker first checks its sessions and raises
`WaitInTransaction`, a programming error, rather than wait.

In pipeline mode libpq says "active" until results are read: a session passes when all it
queued went out with a Sync and ended with COMMIT or ROLLBACK (`Wire.ends_transactions`).
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from psycopg import pq

from outbox_migrate.relay.wire import Wire

PLAIN_SLEEP_MAX_S = 0.05
"""Waits up to this long are a plain sleep (`Event.wait` allocates a lock per call, paid once
per batch by the linger); a stop waits at most this long for them."""

Session = tuple[Any, Wire | None]
"""A connection and its pipeline (None: the session is not pipelined)."""


class WaitInTransaction(RuntimeError):
    """A worker was about to wait with a session inside a transaction: a bug, never retried."""


def check_outside_transaction(sessions: Iterable[Session]) -> None:
    """Raise `WaitInTransaction` if one of `sessions` is, or will stay, in a transaction (a
    closed or broken one holds nothing)."""
    for conn, pipe in sessions:
        if conn is None or conn.closed:
            continue
        pg = conn.pgconn
        if pg.status != pq.ConnStatus.OK:
            continue
        status = pg.transaction_status
        if status == pq.TransactionStatus.IDLE:
            continue
        if status == pq.TransactionStatus.ACTIVE and pipe is not None and pipe.ends_transactions:
            continue
        raise WaitInTransaction(
            f"relay session pid {pg.backend_pid} would wait in transaction state "
            f"{pq.TransactionStatus(status).name}: end the transaction before waiting"
        )


class Waits:
    """A worker's waits; `sessions` returns those that must not be in a transaction."""

    def __init__(self, stop: threading.Event, sessions: Callable[[], Iterable[Session]]) -> None:
        self.stop = stop
        self._sessions = sessions

    def check(self) -> None:
        check_outside_transaction(self._sessions())

    def wait(self, seconds: float) -> bool:
        """Wait `seconds` or until a stop; True: stopping."""
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
        """`poller.poll(timeout_ms)` (the LISTEN session's socket and the stop pipe)."""
        self.check()
        return poller.poll(timeout_ms)
