"""Decode the pgoutput messages a CDC relay needs: Begin, Commit, Relation, Insert.

Protocol version 1 is small and stable since PostgreSQL 10: a decoder over `struct` needs no
dependency. Values arrive as text.
"""

from __future__ import annotations

import struct
import time
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
"""Replication timestamps count microseconds from 2000-01-01 UTC."""
PG_EPOCH_UNIX_S = 946_684_800

_I16 = struct.Struct("!h")
_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")
BEGIN = struct.Struct("!QqI")
COMMIT = struct.Struct("!BQQq")
_XLOG = struct.Struct("!QQq")
KEEPALIVE = struct.Struct("!Qq?")
_STATUS = struct.Struct("!cQQQq?")


class DecodeError(ValueError):
    """A replication message did not have the expected shape (a protocol mismatch)."""


def lsn_text(lsn: int) -> str:
    """PostgreSQL's `X/X` notation of a log sequence number."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def pg_time(micros: int) -> datetime:
    return PG_EPOCH + timedelta(microseconds=micros)


def pg_micros(moment: datetime) -> int:
    return (moment - PG_EPOCH) // timedelta(microseconds=1)


class Begin(NamedTuple):
    """NamedTuples: one per message, and a frozen dataclass costs several times as much."""

    final_lsn: int
    commit_micros: int
    xid: int


class Commit(NamedTuple):
    commit_lsn: int
    end_lsn: int
    """Where the next transaction starts: the position to confirm once this one is done."""
    commit_micros: int


class Relation(NamedTuple):
    oid: int
    namespace: str
    name: str
    columns: tuple[str, ...]
    types: tuple[int, ...] = ()


class Insert(NamedTuple):
    oid: int
    values: tuple[str | None, ...]


class Other(NamedTuple):
    """A message the relay does not act on (Origin, Type, Update, Delete, Truncate, …)."""

    kind: str


Decoded = Begin | Commit | Relation | Insert | Other


def decode(data: bytes | memoryview) -> Decoded:
    """One pgoutput message: the payload of an XLogData frame."""
    buf = bytes(data)
    if not buf:
        raise DecodeError("empty pgoutput message")
    return decode_at(buf, 0)


def insert_at(buf: bytes, at: int) -> Insert:
    """The Insert message starting at `buf[at]` (the stream loop has read its tag)."""
    try:
        return _insert(buf, at)
    except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
        raise DecodeError(f"malformed pgoutput 'I' message: {exc}") from None


def decode_at(buf: bytes, at: int) -> Decoded:
    """The pgoutput message at `buf[at]` (25: an XLogData frame's payload, not copied out). On
    `bytes`, not a memoryview: slicing and decoding bytes costs about half as much per value,
    more than copying the frame once."""
    kind = buf[at]
    try:
        if kind == 0x49:  # 'I'
            return _insert(buf, at)
        if kind == 0x42:  # 'B'
            return Begin._make(BEGIN.unpack_from(buf, at + 1))
        if kind == 0x43:  # 'C'
            _flags, commit_lsn, end_lsn, micros = COMMIT.unpack_from(buf, at + 1)
            return Commit(commit_lsn, end_lsn, micros)
        if kind == 0x52:  # 'R'
            return _relation(buf, at)
    except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
        raise DecodeError(f"malformed pgoutput {chr(kind)!r} message: {exc}") from None
    return Other(chr(kind))


def _cstring(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.index(b"\0", pos)
    return buf[pos:end].decode(), end + 1


def _relation(buf: bytes, at: int) -> Relation:
    (oid,) = _U32.unpack_from(buf, at + 1)
    namespace, pos = _cstring(buf, at + 5)
    name, pos = _cstring(buf, pos)
    pos += 1  # replica identity setting
    (count,) = _I16.unpack_from(buf, pos)
    pos += 2
    columns: list[str] = []
    types: list[int] = []
    for _ in range(count):
        column, pos = _cstring(buf, pos + 1)  # flags byte, then the name
        types.append(_U32.unpack_from(buf, pos)[0])
        pos += 8  # type oid, type modifier
        columns.append(column)
    return Relation(oid, namespace or "pg_catalog", name, tuple(columns), tuple(types))


def _insert(buf: bytes, at: int) -> Insert:
    (oid,) = _U32.unpack_from(buf, at + 1)
    if buf[at + 5] != 0x4E:  # 'N'
        raise DecodeError(f"insert without a new tuple (marker {chr(buf[at + 5])!r})")
    return Insert(oid, _tuple(buf, at + 6))


def _tuple(buf: bytes, pos: int) -> tuple[str | None, ...]:
    (count,) = _I16.unpack_from(buf, pos)
    pos += 2
    values: list[str | None] = []
    append = values.append
    unpack = _I32.unpack_from
    for _ in range(count):
        kind = buf[pos]
        if kind == 0x74:  # 't': text
            (size,) = unpack(buf, pos + 1)
            pos += 5
            append(buf[pos : pos + size].decode())
            pos += size
        elif kind in (0x6E, 0x75):  # 'n' null, 'u' unchanged TOAST (never in an insert)
            append(None)
            pos += 1
        else:
            raise DecodeError(f"unexpected tuple value kind {chr(kind)!r}")
    return tuple(values)


# -- the replication protocol's frames (CopyData payloads) ---------------------------------


class XLogData(NamedTuple):
    start_lsn: int
    wal_end: int
    payload: memoryview


class Keepalive(NamedTuple):
    wal_end: int
    """Safe to confirm when nothing is pending: every transaction before it was sent."""
    reply_requested: bool


def frame(data: bytes | memoryview) -> XLogData | Keepalive:
    buf = memoryview(data)
    if buf[0] == 0x77:  # 'w'
        start, end, _sent = _XLOG.unpack_from(buf, 1)
        return XLogData(start, end, buf[25:])
    if buf[0] == 0x6B:  # 'k'
        end, _sent, reply = KEEPALIVE.unpack_from(buf, 1)
        return Keepalive(end, reply)
    raise DecodeError(f"unexpected replication frame {chr(buf[0])!r}")


def status_update(
    flush_lsn: int, now: datetime | None = None, *, reply: bool = False, written_lsn: int = 0
) -> bytes:
    """A standby status update: flushed = applied = `flush_lsn` (acknowledged and marked);
    written = what the relay received, if further. A logical slot ignores the written
    position, but the walsender pings at each WAL flush while both lag what it sent
    (walsender.c, WalSndWaitForWal)."""
    micros = pg_micros(now) if now else int((time.time() - PG_EPOCH_UNIX_S) * 1_000_000)
    written = max(written_lsn, flush_lsn)
    return _STATUS.pack(b"r", written, flush_lsn, flush_lsn, micros, reply)
