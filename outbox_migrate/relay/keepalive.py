"""How long a vanished relay host can keep its shards: a worker session's timeouts, the
fence that publishes only while its shard lease provably holds, and a broker backoff that
keeps the session alive (docs/relay.md, "A fleet across hosts: shards and fencing").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from psycopg import sql

from outbox_migrate.errors import RelayError

CHECK_INTERVAL_MS = 1000
"""client_connection_check_interval: a running statement polls its socket once a second."""


def probe_interval_s(timeout_s: float) -> int:
    return max(1, math.floor(timeout_s / 6))


def probe_idle_s(timeout_s: float) -> int:
    return max(1, math.floor(timeout_s / 4))


def libpq_params(timeout_s: float) -> dict[str, Any]:
    if timeout_s <= 0:
        return {}
    return {
        "keepalives": 1,
        "keepalives_idle": probe_idle_s(timeout_s),
        "keepalives_interval": probe_interval_s(timeout_s),
        "keepalives_count": 3,
        "tcp_user_timeout": int(timeout_s * 1000),
    }


def server_settings(timeout_s: float, poll_interval_s: float, major: int) -> dict[str, str]:
    # None of these ends a session earlier than T after the client's last message: `Fence`
    # relies on it.
    if timeout_s <= 0:
        return {}
    ms = int(timeout_s * 1000)
    settings = {
        "tcp_keepalives_idle": str(probe_idle_s(timeout_s)),
        "tcp_keepalives_interval": str(probe_interval_s(timeout_s)),
        "tcp_keepalives_count": "3",
        "tcp_user_timeout": str(ms),
        "idle_in_transaction_session_timeout": str(ms),
    }
    if major >= 14:
        settings["idle_session_timeout"] = str(int((timeout_s + poll_interval_s) * 1000))
        settings["client_connection_check_interval"] = str(CHECK_INTERVAL_MS)
    return settings


def arm_idle_timeout(conn: Any) -> None:
    """One plain statement before a worker idles, to arm the server's idle-session timer:
    leaving pipeline mode ends with a flush request that disarms it without re-arming, and a
    relay paused while idle would keep its shards for good."""
    conn.execute(b"SELECT")


def configure_session(
    conn: Any, timeout_s: float, poll_interval_s: float, *, idle_session: bool = True
) -> None:
    """Apply `server_settings` to a worker session (autocommit, before any transaction).
    `idle_session=False` turns `idle_session_timeout` off explicitly, for a session holding
    no shards (read-ahead): cut after every quiet spell, it would cost a backoff each time."""
    from outbox_migrate.db import server_version

    major = server_version(conn)
    settings = server_settings(timeout_s, poll_interval_s, major)
    if not idle_session and major >= 14:
        settings["idle_session_timeout"] = "0"
    if not settings:
        return
    statement = sql.SQL("SELECT {}").format(
        sql.SQL(", ").join(
            sql.SQL("set_config({}, {}, false)").format(sql.Literal(k), sql.Literal(v))
            for k, v in settings.items()
        )
    )
    conn.execute(statement)


# -- fencing -----------------------------------------------------------------------------

MARGIN_S = 1.0
"""Clock and scheduling slack between our monotonic clock and the server's timers."""


class LeaseUnproven(RelayError):
    """The batch was not published: the lease could expire before the publish ends."""


class Fence:
    """When this worker last proved its session alive, and whether a publish still fits:
    the server ends the session no earlier than T after a claim sent at `t` came back."""

    def __init__(self, session_timeout_s: float, publish_budget_s: float) -> None:
        self.session_timeout_s = session_timeout_s
        self.publish_budget_s = publish_budget_s
        self.proven_at = float("-inf")
        """Monotonic time a round trip that succeeded was sent."""

    @property
    def enabled(self) -> bool:
        return self.session_timeout_s > 0

    def proven(self, sent_at: float) -> None:
        self.proven_at = max(self.proven_at, sent_at)

    def lost(self) -> None:
        self.proven_at = float("-inf")

    def deadline(self) -> float:
        return self.proven_at + self.session_timeout_s - MARGIN_S - self.publish_budget_s

    def check(self, now: float) -> None:
        if self.enabled and now > self.deadline():
            raise LeaseUnproven(
                f"shard lease proven {now - self.proven_at:.1f} s ago; a publish of up to "
                f"{self.publish_budget_s:g} s could end after the session timeout "
                f"({self.session_timeout_s:g} s)"
            )


# -- outage waits ------------------------------------------------------------------------

PING_SHARE = 3
"""Pings per idle-session timeout: the session speaks at least this often within it."""
MIN_PING_S = 0.2
"""No faster than this, however short the server's timeout."""


def idle_timeout_s(conn: Any) -> float:
    row = conn.execute(
        "SELECT setting::float8 / 1000 FROM pg_settings WHERE name = 'idle_session_timeout'"
    ).fetchone()
    return float(row[0]) if row and row[0] else 0.0


def ping_interval_s(timeout_s: float) -> float | None:
    if timeout_s <= 0:
        return None
    return max(MIN_PING_S, timeout_s / PING_SHARE)


def back_off_keeping_session(wait: Callable[[float], bool], seconds: float, conn: Any) -> bool:
    """Wait `seconds`, pinging `conn` (autocommit) so the server does not end it as idle: a
    session found dead at the wake-up would cost another full backoff. False: it was lost
    anyway (the wait still runs its full length), and the caller reopens it first."""
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
