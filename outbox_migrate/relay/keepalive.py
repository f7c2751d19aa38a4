"""Dead-session detection with a bound: how long a vanished relay host can keep its shards.

Shards are session advisory locks, released only when the server ends the session; after a
partition, a power cut or a paused process, default keepalives keep it for hours. So for a
session timeout T (`--session-timeout`), each worker session gets:

* server side (settable by any role): `tcp_user_timeout = T` with frequent keepalive probes,
  for a peer that stops answering; `idle_in_transaction_session_timeout = T`, for one that
  answers TCP but stopped talking mid-batch; on PostgreSQL 14+, `idle_session_timeout =
  T + poll interval` for the same between batches, and `client_connection_check_interval`;
* client side, through libpq: the same keepalives and `tcp_user_timeout`, so the relay's own
  pending statement fails instead of waiting for hours.

None of these ends a session *earlier* than T after the client's last message, which
`Fence` below relies on. Shards are free at most T plus one probe interval (or plus the poll
interval for an idle relay) later.

Fencing (`Fence`): never hand a batch to the broker unless this session provably still owns
it. Shards and batch rows are locks of the worker's session, which the server ends no earlier
than T after its last message from the worker. So when a claim sent at `t` returns, every lock
is safe until at least `t + T`, and a batch is published only if the publish (bounded by the
sink's timeout) ends before `t + T - MARGIN_S`: a relay cut off from PostgreSQL stops
publishing before another can have claimed its shards. Not covered: a process paused *inside*
a sink call resumes after its session may have ended; those messages arrive late, as
duplicates (docs/relay.md, "Fleet guarantees").

A worker's backoff while its broker is away (`back_off_keeping_session`) keeps its session
usable: the backoff can outlast the server's `idle_session_timeout`, and a session found dead
at the wake-up costs another full backoff, so a broker back briefly between outages is missed
time after time. So the wait is cut into slices shorter than a third of that timeout, with a
bare `SELECT` between them (autocommit: never in a transaction); a session lost anyway is
reported before the wake-up, so the worker reconnects first instead of failing again.
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
    """Seconds between keepalive probes: about six probes fit in the timeout."""
    return max(1, math.floor(timeout_s / 6))


def probe_idle_s(timeout_s: float) -> int:
    """Seconds of silence before the first probe: a quarter of the timeout."""
    return max(1, math.floor(timeout_s / 4))


def libpq_params(timeout_s: float) -> dict[str, Any]:
    """Connection parameters for the client side (libpq's own names)."""
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
    """Per-session settings for the server side of a worker session."""
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

    `idle_session=False` turns `idle_session_timeout` off explicitly (a server, database or
    role setting would apply otherwise) for a session holding no shards (read-ahead): cut
    after every quiet spell, it would cost a full backoff each time."""
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
    """When this worker last proved its session alive, and whether a publish still fits."""

    def __init__(self, session_timeout_s: float, publish_budget_s: float) -> None:
        self.session_timeout_s = session_timeout_s
        self.publish_budget_s = publish_budget_s
        self.proven_at = float("-inf")
        """Monotonic time a round trip that succeeded was sent."""

    @property
    def enabled(self) -> bool:
        return self.session_timeout_s > 0

    def proven(self, sent_at: float) -> None:
        """A statement sent at `sent_at` came back: the session was alive after that."""
        self.proven_at = max(self.proven_at, sent_at)

    def lost(self) -> None:
        """A new session holds nothing yet: no proof carries over."""
        self.proven_at = float("-inf")

    def deadline(self) -> float:
        """The last moment a publish may *start*."""
        return self.proven_at + self.session_timeout_s - MARGIN_S - self.publish_budget_s

    def check(self, now: float) -> None:
        """Raise `LeaseUnproven` when a publish starting `now` could outlive the lease."""
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
