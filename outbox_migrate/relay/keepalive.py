"""Dead-session detection with a bound: how long a vanished relay host can keep its shards.

A relay's shards are session advisory locks, and PostgreSQL releases them only when it ends
the session. After a network partition, a power cut or a paused process the server sees no
error: with the operating system's default keepalive settings (two hours idle on Linux) the
session — and every shard it holds — stays until someone notices. Each worker session
therefore gets, for a session timeout T (`--session-timeout`):

* server side, per session (all settable by any role): `tcp_user_timeout = T` with keepalive
  probes every few seconds, so a peer that stops answering is dropped once nothing came from
  it for T (Linux closes at the first probe after T: at most one probe interval later);
  `idle_in_transaction_session_timeout = T`, for a peer that still answers TCP but stopped
  talking (SIGSTOP, a frozen VM) in the middle of a batch; and, on PostgreSQL 14 or newer,
  `idle_session_timeout = T + poll interval` for the same between batches, plus
  `client_connection_check_interval`, so a running statement notices a closed client;
* client side, through libpq: the same keepalives and `tcp_user_timeout`, so the partitioned
  relay's own pending statement fails instead of waiting for hours, and it reconnects.

None of these can end a session *earlier* than T after the last message the server received
from the client — which `fencing.Fence` relies on. The upper bound on "the shards are free" is
T plus one probe interval (or T plus the poll interval for a paused, idle relay); the
survivors take them at their next rebalance (`shards.REBALANCE_S`).
"""

from __future__ import annotations

import math
from typing import Any

from psycopg import sql

DEFAULT_SESSION_TIMEOUT_S = 12.0
"""With the default 10 s sink timeout the fence needs T > 12 s - 1 s of margin; 12 s keeps
"shards served again" within about 15 s (T + a 2 s probe interval + a 1 s rebalance)."""
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
    """One plain statement before a worker idles: arms the server's idle-session timer.

    PostgreSQL starts `idle_session_timeout` when it reports ready for a query, and disarms it
    on any message it reads. Leaving psycopg's pipeline mode ends with a flush request after
    the last Sync, which disarms the timer without re-arming it; a relay paused while idle
    after a pipelined run would then keep its shards for good (measured: the session stayed
    idle past its timeout). A simple query re-arms it; it is only sent when the worker is
    about to wait for work, never between batches.
    """
    conn.execute(b"SELECT")


def configure_session(
    conn: Any, timeout_s: float, poll_interval_s: float, *, idle_session: bool = True
) -> None:
    """Apply `server_settings` to a worker session (autocommit, before any transaction).

    `idle_session=False` turns `idle_session_timeout` off: it exists to free the shards of a
    silent relay, and a session that holds none (the read-ahead session) would only be cut
    between backlogs for nothing. Off explicitly, not merely left unset: a timeout set for the
    server, database or role would otherwise apply, and the worker found its read-ahead
    session dead after every quiet spell or broker outage longer than it — "connection lost",
    and a full backoff before it published again."""
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
