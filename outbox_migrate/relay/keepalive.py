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
`fencing.Fence` relies on. Shards are free at most T plus one probe interval (or plus the poll
interval for an idle relay) later.
"""

from __future__ import annotations

import math
from typing import Any

from psycopg import sql

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
