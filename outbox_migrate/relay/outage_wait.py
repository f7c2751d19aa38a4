"""A worker's backoff while its broker is away, with its PostgreSQL session kept usable.

Why: the backoff grows to `--backoff-cap` (30 s by default), and a session that says nothing
for longer than the server's `idle_session_timeout` (the relay sets it to the session timeout
plus the poll interval, 13 s by default; a server or role may set its own) is ended by the
server. The worker then found its session dead only when it woke up: that wake-up went to
"connection lost" and another full backoff before it reconnected and tried the broker again,
so a broker back for 15 s between outages could be missed time after time (a NATS relay
published nothing in 145 s through three 15-s up windows). Here the wait is cut into slices
shorter than a third of the session's idle timeout and the session answers a bare `SELECT`
between them (autocommit: never inside a transaction, and the worker holds no shards while it
backs off); a session lost anyway (a restart, a network cut) is reported before the wake-up,
so the worker reconnects as its first step instead of failing and sleeping again.

It must not: hold a transaction or a lock, publish, or decide the backoff (the worker does).
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
    """The session's `idle_session_timeout` in seconds; 0 when it is off (or before
    PostgreSQL 14, which has no such setting)."""
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
    """Wait `seconds` (or until `wait` reports a stop), keeping `conn` from being ended as idle;
    `wait(s)` waits up to `s` seconds, True when stopping (the worker's `Waits.wait`, which
    refuses to wait with a session in a transaction).

    True: the session is still usable (it answered a ping at the end of the wait); False: it
    was lost meanwhile — the wait still runs its full length (the broker gets its backoff),
    and the caller reopens the session before it goes on.
    """
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
