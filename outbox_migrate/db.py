"""Connections: every one the tool opens goes through `connect`, so `pg_stat_activity` shows
`outbox-migrate/<version>` (the deploy gates tell our sessions apart), the unpublished guard
lets our sessions through, and a failure is one masked line, never a password or a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from outbox_migrate import __version__
from outbox_migrate.dsn import EMBEDDED, mask, password_of
from outbox_migrate.errors import ConnectError

if TYPE_CHECKING:
    import psycopg
    from psycopg.rows import RowFactory

APPLICATION_NAME = f"outbox-migrate/{__version__}"
CONNECT_TIMEOUT_S = 10
GUARD_SETTING = "outbox_migrate.unpublished_guard"
"""The session setting the unpublished partition's guard reads (patterns/kinds/guard.py):
`off` lets the session's DELETEs remove unpublished rows."""
GUARD_OFF = f"SET {GUARD_SETTING} = off"


def resolve_embedded(dsn: str) -> str:
    """Map the `embedded` pseudo-DSN to the running embedded server's real DSN."""
    if dsn == EMBEDDED:
        from outbox_migrate import embedded

        return embedded.start()
    return dsn


def connect(
    dsn: str,
    *,
    application_name: str = APPLICATION_NAME,
    row_factory: RowFactory[Any] | None = None,
    params: dict[str, Any] | None = None,
) -> psycopg.Connection[Any]:
    """Open a connection, or raise `ConnectError` with a masked, single-line reason.

    Autocommit: the tool manages its transactions explicitly
    (`with conn.transaction():`) so that no statement ever runs in an implicit, forgotten
    transaction that would hold locks or an old snapshot. `params` are further libpq
    connection parameters (the relay's keepalives).
    """
    import psycopg

    real = resolve_embedded(dsn)
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "application_name": application_name,
        "connect_timeout": CONNECT_TIMEOUT_S,
    }
    if row_factory is not None:
        kwargs["row_factory"] = row_factory
    kwargs.update(params or {})
    try:
        conn = psycopg.connect(real, **kwargs)
        try:
            # A SET, not `options=-c …` at startup: PgBouncer refuses a startup option it
            # does not track; this costs one round trip per connection, none per statement.
            conn.execute(GUARD_OFF)
        except BaseException:
            conn.close()
            raise
        return conn
    except psycopg.Error as exc:
        raise ConnectError(
            f"cannot connect to {describe(dsn)}: {one_line(str(exc), real)}"
        ) from None


def describe(dsn: str) -> str:
    """How to name a DSN in a message: masked, or a word when it is implicit."""
    if dsn == EMBEDDED:
        return "the embedded PostgreSQL"
    if not dsn:
        return "the database named by PG* variables"
    return mask(dsn)


_NOISE = re.compile(r"^(connection failed:|connection to server .*? failed:)\s*", re.I)


def one_line(message: str, dsn: str = "") -> str:
    """Collapse a libpq/psycopg message to its most useful line, passwords removed."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    text = lines[0] if lines else "unknown error"
    # libpq prefixes "connection failed: connection to server at ... failed:"; keep the cause.
    while True:
        stripped = _NOISE.sub("", text)
        if stripped == text or not stripped:
            break
        text = stripped
    text = re.sub(r"^FATAL:\s*", "", text)
    secret = password_of(dsn) or ""
    return mask(text, secret)


def server_version(conn: psycopg.Connection[Any]) -> int:
    """Major version of the server (14, 15, ...)."""
    return int(conn.info.server_version // 10000)


@contextmanager
def lock_timeout(conn: psycopg.Connection[Any], ms: int) -> Iterator[None]:
    """`SET lock_timeout` for the statements of the block (autocommit: each is its own
    transaction, so `SET LOCAL` would not reach them), reset when it ends however it ends."""
    from psycopg import sql

    conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{ms}ms")))
    try:
        yield
    finally:
        conn.execute("RESET lock_timeout")


@contextmanager
def try_session_lock(conn: psycopg.Connection[Any], key: str) -> Iterator[bool]:
    """The session advisory lock `hashtext(key)`, not waited for: yields whether it was
    taken, and gives it back at the end of the block when it was."""
    row = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (key,)).fetchone()
    taken = bool(row and row[0])
    try:
        yield taken
    finally:
        if taken:
            conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (key,))
