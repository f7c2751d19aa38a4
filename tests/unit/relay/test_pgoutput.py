"""The pgoutput decoder against hand-built protocol messages (the byte layouts are the
protocol's, documented in PostgreSQL's "Logical Replication Message Formats")."""

from __future__ import annotations

import struct
from datetime import UTC, datetime

import pytest

from outbox_migrate.relay.cdc import pgoutput

WHEN = datetime(2026, 11, 23, 19, 0, 0, 123456, tzinfo=UTC)


def _text(value: str | None) -> bytes:
    if value is None:
        return b"n"
    raw = value.encode()
    return b"t" + struct.pack("!i", len(raw)) + raw


def test_begin_commit_relation_insert() -> None:
    micros = pgoutput.pg_micros(WHEN)
    begin = pgoutput.decode(b"B" + struct.pack("!QqI", 0x1_0000_0010, micros, 742))
    assert begin == pgoutput.Begin(0x1_0000_0010, micros, 742)
    assert pgoutput.pg_time(begin.commit_micros) == WHEN
    commit = pgoutput.decode(b"C" + struct.pack("!BQQq", 0, 0x20, 0x48, micros))
    assert commit == pgoutput.Commit(0x20, 0x48, micros)
    columns = [b"id", b"payload", b"created_at"]
    relation = (
        b"R" + struct.pack("!I", 16400) + b"public\0outbox_unpublished\0" + b"d"
        + struct.pack("!h", len(columns))
        + b"".join(b"\x01" + c + b"\0" + struct.pack("!Ii", 20, -1) for c in columns)
    )  # fmt: skip
    assert pgoutput.decode(relation) == pgoutput.Relation(
        16400, "public", "outbox_unpublished", ("id", "payload", "created_at"), (20, 20, 20)
    )
    values = ["1000001", '{"ä": 1}', None]
    insert = b"I" + struct.pack("!I", 16400) + b"N" + struct.pack("!h", 3)
    insert += b"".join(_text(v) for v in values)
    assert pgoutput.decode(insert) == pgoutput.Insert(16400, tuple(values))
    assert pgoutput.decode(b"U\0\0") == pgoutput.Other("U")


def test_malformed_messages_raise_decode_error() -> None:
    with pytest.raises(pgoutput.DecodeError):
        pgoutput.decode(b"B\0\0")
    with pytest.raises(pgoutput.DecodeError):
        pgoutput.decode(b"I" + struct.pack("!I", 1) + b"K")
    with pytest.raises(pgoutput.DecodeError):
        pgoutput.decode(b"")


def test_frames_and_status_update() -> None:
    payload = b"B" + struct.pack("!QqI", 5, 0, 1)
    frame = pgoutput.frame(b"w" + struct.pack("!QQq", 0x10, 0x99, 0) + payload)
    assert isinstance(frame, pgoutput.XLogData)
    assert (frame.start_lsn, frame.wal_end, bytes(frame.payload)) == (0x10, 0x99, payload)
    keepalive = pgoutput.frame(b"k" + struct.pack("!Qq?", 0x77, 0, True))
    assert keepalive == pgoutput.Keepalive(0x77, True)
    update = pgoutput.status_update(0x1_0000_0042, WHEN, reply=True)
    kind, write, flush, apply, micros, reply = struct.unpack("!cQQQq?", update)
    assert (kind, write, flush, apply, reply) == (b"r", 0x1_0000_0042, 0x1_0000_0042,
                                                  0x1_0000_0042, True)  # fmt: skip
    assert pgoutput.pg_time(micros) == WHEN


def test_lsn_notation_round_trips() -> None:
    assert pgoutput.lsn_text(0x1_0000_00AB) == "1/AB"
    assert pgoutput.parse_lsn("16/B374D848") == (0x16 << 32) | 0xB374D848


def test_status_update_reports_what_was_received_as_written_and_only_the_confirmed_as_flushed() -> (
    None
):
    update = pgoutput.status_update(0x40, WHEN, written_lsn=0x90)
    _tag, written, flushed, applied, _micros, reply = struct.unpack("!cQQQq?", update)
    assert (written, flushed, applied, reply) == (0x90, 0x40, 0x40, False)
    # Never a written position behind the flushed one.
    update = pgoutput.status_update(0x40, WHEN, written_lsn=0x10)
    assert struct.unpack("!cQQQq?", update)[1:4] == (0x40, 0x40, 0x40)


def test_a_streamed_transaction_is_visible_only_once_a_snapshot_shows_it_ended() -> None:
    """The CDC mark's check (relay/cdc/marks.py): pgoutput names a transaction by its 32-bit
    xid, the snapshot lists 64-bit ones; widened against xmax, across an epoch too."""
    from outbox_migrate.relay.cdc.marks import visible

    assert visible(700, "750:800:")  # below xmin
    assert visible(760, "750:800:755,770")  # ended, between xmin and xmax
    assert not visible(770, "750:800:755,770")  # still running
    assert not visible(800, "750:800:")  # at xmax: not ended when the snapshot was taken
    assert not visible(900, "750:800:")  # past xmax
    epoch = 1 << 32
    assert visible(2**32 - 10, f"{epoch - 20}:{epoch + 5}:{epoch + 1}")  # before the wrap
    assert not visible(1, f"{epoch - 20}:{epoch + 5}:{epoch + 1}")  # after it, running
    assert visible(3, f"{epoch - 20}:{epoch + 5}:{epoch + 1}")
