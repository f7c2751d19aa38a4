"""The logical replication protocol over psycopg 3's libpq layer, no other dependency.

Its commands are the walsender's grammar, not SQL: they stay here.
"""

from __future__ import annotations

import select

from psycopg import OperationalError, pq
from psycopg.conninfo import make_conninfo
from psycopg.pq.abc import PGresult

from outbox_migrate.db import CONNECT_TIMEOUT_S, one_line, resolve_embedded
from outbox_migrate.errors import ConnectError
from outbox_migrate.relay.cdc import pgoutput

STREAM_OPTIONS = "-c datestyle=ISO -c timezone=UTC -c extra_float_digits=3"
"""The walsender renders text values with its own settings: pin those the relay parses."""


class StreamLost(Exception):
    """The replication connection broke; the caller reconnects and resumes from the slot."""


class ReplicationStream:
    """One START_REPLICATION session on a slot; frames in, status updates out."""

    def __init__(self, dsn: str, application_name: str) -> None:
        real = resolve_embedded(dsn)
        conninfo = make_conninfo(
            real, replication="database", application_name=application_name,
            connect_timeout=CONNECT_TIMEOUT_S, options=STREAM_OPTIONS,
        )  # fmt: skip
        self._conn = pq.PGconn.connect(conninfo.encode())
        if self._conn.status != pq.ConnStatus.OK:
            reason = self._conn.get_error_message()
            self._conn.finish()
            raise ConnectError(f"cannot open a replication connection: {one_line(reason, real)}")
        self._conn.nonblocking = 1

    def start(self, slot: str, publication: str) -> None:
        """Begin streaming after the slot's confirmed position (0/0 means the slot's)."""
        from psycopg import sql

        command = sql.SQL(
            "START_REPLICATION SLOT {} LOGICAL 0/0 (proto_version '1', publication_names {})"
        ).format(
            sql.Identifier(slot),
            sql.Literal(publication),  # names are checked to be plain lower-case identifiers
        )
        self._command(command.as_string(None).encode(), pq.ExecStatus.COPY_BOTH)

    def create_slot(self, slot: str, *, failover: bool, server_version: int) -> tuple[int, str]:
        """Create the slot with an exported snapshot, which shows exactly the rows committed
        before its first streamed change, until the next command: (consistent point, name)."""
        from psycopg import sql

        if server_version >= 150000:
            extra = ", FAILOVER true" if failover else ""
            options = sql.SQL(" (SNAPSHOT 'export'" + extra + ")")
        else:
            options = sql.SQL(" EXPORT_SNAPSHOT")
        command = sql.SQL("CREATE_REPLICATION_SLOT {} LOGICAL pgoutput{}").format(
            sql.Identifier(slot), options
        )
        result = self._command(command.as_string(None).encode(), pq.ExecStatus.TUPLES_OK)
        point = result.get_value(0, 1) or b"0/0"
        snapshot = result.get_value(0, 2) or b""
        return pgoutput.parse_lsn(point.decode()), snapshot.decode()

    def release_snapshot(self) -> None:
        """End the exported snapshot, whose xmin keeps VACUUM from removing rows, with a
        command that changes nothing."""
        self._command(b"IDENTIFY_SYSTEM", pq.ExecStatus.TUPLES_OK)

    def _command(self, command: bytes, expect: pq.ExecStatus) -> PGresult:
        self._conn.send_query(command)
        self._flush()
        while True:
            self.receive()
            if not self._conn.is_busy():
                break
            self._wait(1.0)
        result = self._conn.get_result()
        if result is None or result.status != expect:
            message = (result.error_message if result else b"") or self._conn.error_message
            raise StreamLost(
                f"{command.split(b' ')[0].decode()} failed: "
                f"{message.decode(errors='replace').strip()}"
            )
        if expect != pq.ExecStatus.COPY_BOTH:
            while self._conn.get_result() is not None:  # drain to the end of the command
                pass
        return result

    def read(self, timeout_s: float) -> pgoutput.XLogData | pgoutput.Keepalive | None:
        """The next frame, or None when nothing arrived within `timeout_s`."""
        size, data = self._conn.get_copy_data(1)
        if size == 0:
            if not self._wait(timeout_s):
                return None
            self.receive()
            size, data = self._conn.get_copy_data(1)
            if size == 0:
                return None
        if size < 0:
            raise StreamLost(self._conn.get_error_message() or "replication stream ended")
        return pgoutput.frame(data)

    def drain(self) -> list[bytes]:
        """Every CopyData frame libpq has already received, without touching the socket: one
        call per wake-up rather than per frame."""
        frames: list[bytes] = []
        get = self._conn.get_copy_data
        size, data = get(1)
        while size > 0:
            frames.append(bytes(data))  # the decoder slices and decodes bytes (cheaper)
            size, data = get(1)
        if size < 0:
            if frames:  # hand over what arrived before the end; the next call raises
                return frames
            raise StreamLost(self._conn.get_error_message() or "replication stream ended")
        return frames

    def wait(self, timeout_s: float, also: int | None = None) -> bool:
        """Wait for the socket and read it into libpq's buffer (True), or until `timeout_s`
        or only socket `also` (the marks session) is readable (False)."""
        if not self._wait(timeout_s, also):
            return False
        self.receive()
        return True

    def confirm(self, lsn: int, *, reply: bool = False, received: int = 0) -> None:
        """Report `lsn` as flushed (the server may discard WAL before it), and `received` as
        written (`pgoutput.status_update`)."""
        message = pgoutput.status_update(lsn, reply=reply, written_lsn=received)
        if self._conn.put_copy_data(message) < 0:
            raise StreamLost(self._conn.get_error_message() or "status update failed")
        self._flush()

    def close(self) -> None:
        self._conn.finish()

    def _wait(self, timeout_s: float, also: int | None = None) -> bool:
        """True when the stream's socket is readable (False: timeout, or only `also` is)."""
        sock = self._conn.socket
        try:
            ready, _, _ = select.select([sock] if also is None else [sock, also], [], [], timeout_s)
        except (OSError, ValueError) as exc:
            raise StreamLost(f"replication socket: {exc}") from None
        return sock in ready

    def receive(self) -> None:
        """Read whatever the socket holds into libpq's buffer, without waiting."""
        try:
            self._conn.consume_input()
        except OperationalError as exc:  # the server went away
            raise StreamLost(str(exc) or "replication connection lost") from None

    def _flush(self) -> None:
        try:
            while self._conn.flush() == 1:
                select.select([], [self._conn.socket], [], 1.0)
        except OperationalError as exc:
            raise StreamLost(str(exc) or "replication connection lost") from None
