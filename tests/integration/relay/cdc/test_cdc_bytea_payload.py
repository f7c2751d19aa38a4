"""The CDC relay on an outbox whose payload is `bytea` (django-jaiminho stores pickles): a
payload of UTF-8 bytes is sent as that text, any other as the raw bytes it holds — from the
backlog (a SELECT: bytes) and from the stream (pgoutput text: `\\x…` hex). Before, the stream
sent the hex text itself as the payload, and the backlog a Python bytes object's text."""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Sequence

import psycopg
import pytest

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.cdc.relay import CdcRelay, running
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import CdcOptions
from tests.integration.relay.conftest import Collected

from .conftest import drop_slots, wait_for

SPEC = OutboxSpec(table="jm", partitioned_table="jm_new", unpublished_partition="jm_unpublished",
                  published_partition="jm_published")  # fmt: skip
PICKLED = pickle.dumps({"order": 7}, protocol=4)  # starts with 0x80: not UTF-8
TEXT = b'{"order": 8}'


@pytest.fixture
def bytea_outbox(dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE jm_new (id bigint GENERATED ALWAYS AS IDENTITY, payload bytea NOT NULL, "
            "created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz) "
            "PARTITION BY LIST (published_at); "
            "CREATE TABLE jm_unpublished PARTITION OF jm_new FOR VALUES IN (NULL); "
            "CREATE INDEX ON jm_unpublished (id); "
            "CREATE TABLE jm_published PARTITION OF jm_new DEFAULT"
        )
        try:
            yield conn
        finally:
            drop_slots(dsn)


def _insert(conn: psycopg.Connection, *payloads: bytes) -> None:
    for payload in payloads:
        conn.execute("INSERT INTO jm_new (payload) VALUES (%s)", (payload,))


def test_bytea_payloads_are_sent_as_text_or_raw_bytes(
    dsn: str, bytea_outbox: psycopg.Connection, collected: Collected
) -> None:
    _insert(bytea_outbox, TEXT, PICKLED)  # the backlog, read before the slot's point
    relay = CdcRelay(dsn, collected.factory(), spec=SPEC, options=CdcOptions(backoff_cap_s=0.5))
    with running(relay):
        wait_for(lambda: len(collected.ids) >= 2, what="the backlog")
        _insert(bytea_outbox, TEXT, PICKLED)  # through the stream
        wait_for(lambda: len(collected.ids) >= 4, what="the streamed rows")
    payloads = [m.payload for m in sorted(collected.messages, key=lambda m: m.id)]
    assert payloads == [TEXT.decode(), PICKLED, TEXT.decode(), PICKLED]
    assert collected.duplicates() == 0


def test_a_raw_payload_a_json_sink_cannot_carry_is_dead_lettered_with_its_bytes(
    dsn: str, bytea_outbox: psycopg.Connection
) -> None:
    """The stdout sink refuses a pickle (its JSON lines cannot carry it). The CDC relay's dead
    letters had no `payload_bytes`: the bytes went into the text `payload` as whatever the
    driver made of them. Now, as in polling mode (one implementation), they are kept in
    `payload_bytes`, their hex text in `payload`, and the others are written."""
    import io
    import json

    from outbox_migrate.relay.sinks.stdout import StdoutSink

    stream = io.StringIO()
    relay = CdcRelay(dsn, lambda: StdoutSink(stream=stream), spec=SPEC,
                     options=CdcOptions(backoff_cap_s=0.5, max_attempts=2))  # fmt: skip
    with running(relay):
        _insert(bytea_outbox, TEXT, PICKLED, TEXT)
        wait_for(
            lambda: bytea_outbox.execute("SELECT count(*) FROM jm_unpublished").fetchone() == (0,),
            what="every row settled",
        )
    written = [json.loads(line)["id"] for line in stream.getvalue().splitlines()]
    dead = bytea_outbox.execute(
        "SELECT id, attempts, payload, payload_bytes, last_error FROM outbox_dead_letter"
    ).fetchall()
    assert len(dead) == 1 and dead[0][1] == 2, dead
    assert bytes(dead[0][3]) == PICKLED and dead[0][2] == "\\x" + PICKLED.hex()
    assert "UTF-8" in dead[0][4]
    assert sorted(set(written)) == sorted(
        i
        for (i,) in bytea_outbox.execute("SELECT id FROM jm_published").fetchall()
        if i != dead[0][0]
    )
    assert relay.stats.rejected == 2 and relay.stats.dead_lettered == 1


def test_a_message_the_sink_cannot_represent_is_a_bad_row_not_a_crash(
    dsn: str, bytea_outbox: psycopg.Connection, collected: Collected
) -> None:
    """A sink that renders a JSON envelope raises `UnrepresentableMessage` for a raw payload.
    The CDC relay re-raised it and stopped, on every restart; now, as in polling mode, that
    message is set aside and the rest published again, counted as a bad row (no backoff)
    and dead-lettered at max attempts with its bytes."""

    def envelope(batch: Sequence[Message]) -> None:
        for message in batch:
            message.envelope()  # UnrepresentableMessage for the pickle

    relay = CdcRelay(dsn, collected.factory(envelope), spec=SPEC,
                     options=CdcOptions(backoff_cap_s=30.0, max_attempts=3))  # fmt: skip
    with running(relay):
        _insert(bytea_outbox, TEXT, PICKLED, TEXT)
        wait_for(
            lambda: bytea_outbox.execute("SELECT count(*) FROM jm_unpublished").fetchone() == (0,),
            timeout_s=10.0,  # no backoff between its attempts (a rejection's would be 30 s)
            what="every row settled",
        )
    dead = bytea_outbox.execute(
        "SELECT attempts, payload_bytes, last_error FROM outbox_dead_letter"
    ).fetchall()
    assert [(d[0], bytes(d[1])) for d in dead] == [(3, PICKLED)], dead
    assert "not UTF-8" in dead[0][2]
    assert len(set(collected.ids)) == 2 and PICKLED not in [m.payload for m in collected.messages]
    assert relay.stats.bad_rows == 3 and relay.stats.rejected == 0
