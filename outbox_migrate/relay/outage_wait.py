"""A worker's backoff while its broker is away, with its PostgreSQL session kept usable.

The backoff can outlast the server's `idle_session_timeout`: a session found dead at the
wake-up costs another full backoff, and a broker back briefly between outages is missed time
after time. So the wait is cut into slices shorter than a third of that timeout, with a bare
`SELECT` between them (autocommit: never in a transaction); a session lost anyway is
reported before the wake-up, so the worker reconnects first instead of failing again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PING_SHARE = 3
"""Pings per idle-session timeout: the session speaks at least this often within it."""
MIN_PING_S = 0.2
"""No faster than this, however short the server's timeout."""


def idle_timeout_s(conn: Any) -> float:
    """The session's `idle_session_timeout` in seconds; 0 when off (or before PostgreSQL 14)."""
    row = conn.execute(
        "SELECT setting::float8 / 1000 FROM pg_settings WHERE name = 'idle_session_timeout'"
    ).fetchone()
    return float(row[0]) if row and row[0] else 0.0


def ping_interval_s(timeout_s: float) -> float | None:
    """How often to ping a session with this idle timeout; None: never needed."""
    if timeout_s <= 0:
        return None
    return max(MIN_PING_S, timeout_s / PING_SHARE)


def back_off_keeping_session(wait: Callable[[float], bool], seconds: float, conn: Any) -> bool:
    """Wait `seconds` through `wait` (True when stopping), keeping `conn` from being ended as
    idle. True: the session is usable; False: it was lost (the wait still runs its full
    length), and the caller reopens it."""
    import psycopg

    deadline = time.monotonic() + seconds
    try:
        every = ping_interval_s(idle_timeout_s(conn))
        while (left := deadline - time.monotonic()) > 0:
            if wait(left if every is None else min(left, every)):
                return True  # stopping: the worker's shutdown closes the session anyway
            conn.execute(b"SELECT")
    except (psycopg.OperationalError, psycopg.InterfaceError):
        wait(max(0.0, deadline - time.monotonic()))
        return False
    return True
