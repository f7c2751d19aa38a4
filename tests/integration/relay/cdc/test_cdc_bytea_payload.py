"""The CDC relay on an outbox whose payload is `bytea` (django-jaiminho stores pickles): a
payload of UTF-8 bytes is sent as that text, any other as the raw bytes it holds — from the
backlog (a SELECT: bytes) and from the stream (pgoutput text: `\\x…` hex). Before, the stream
sent the hex text itself as the payload, and the backlog a Python bytes object's text."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import psycopg
import pytest

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.cdc.options import CdcOptions
from outbox_migrate.relay.cdc.relay import CdcRelay, running
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
