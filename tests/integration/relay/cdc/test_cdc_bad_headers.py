"""The CDC relay on an outbox with a text headers column (Brighter's HeaderBag, eventuate's
headers): a row whose headers are not a JSON object is that row's problem — dead-lettered at
once with the reason, from the backlog and from the stream — and every other row flows with
its headers. Before, invalid JSON raised while the frame was decoded (the relay stopped, and
stopped again on every restart until the crash guard had counted max-attempts deaths), and a
JSON value that is not an object was sent without a word."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.cdc.relay import CdcRelay, running
from outbox_migrate.relay.options import CdcOptions
from tests.integration.relay.conftest import Collected

from .conftest import drop_slots, wait_for

SPEC = OutboxSpec(table="hb", partitioned_table="hb_new", unpublished_partition="hb_unpublished",
                  published_partition="hb_published")  # fmt: skip
GOOD = '{"trace": "t-1"}'
BAD = ("not json at all", "[1, 2]")


@pytest.fixture
def text_headers_outbox(dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE hb_new (id bigint GENERATED ALWAYS AS IDENTITY, payload jsonb NOT NULL, "
            "headers text, created_at timestamptz NOT NULL DEFAULT now(), "
            "published_at timestamptz) PARTITION BY LIST (published_at); "
            "CREATE TABLE hb_unpublished PARTITION OF hb_new FOR VALUES IN (NULL); "
            "CREATE INDEX ON hb_unpublished (id); "
            "CREATE TABLE hb_published PARTITION OF hb_new DEFAULT"
        )
        try:
            yield conn
        finally:
            drop_slots(dsn)


def _insert(conn: psycopg.Connection) -> None:
    for headers in (GOOD, *BAD, GOOD):
        conn.execute("INSERT INTO hb_new (payload, headers) VALUES ('{}', %s)", (headers,))


def test_rows_whose_headers_are_not_an_object_are_dead_lettered_and_the_rest_flow(
    dsn: str, text_headers_outbox: psycopg.Connection, collected: Collected
) -> None:
    conn = text_headers_outbox
    _insert(conn)  # the backlog
    relay = CdcRelay(dsn, collected.factory(), spec=SPEC, options=CdcOptions(backoff_cap_s=0.5))
    with running(relay):
        wait_for(lambda: len(collected.ids) >= 2, what="the backlog's good rows")
        _insert(conn)  # through the stream
        wait_for(lambda: len(collected.ids) >= 4, what="the streamed good rows")
        wait_for(
            lambda: conn.execute("SELECT count(*) FROM hb_unpublished").fetchone() == (0,),
            what="every row marked",
        )
        dead = conn.execute("SELECT id, last_error FROM outbox_dead_letter ORDER BY id").fetchall()
    assert len(collected.ids) == 4 and collected.duplicates() == 0
    assert all(dict(m.extra_headers).get("trace") == "t-1" for m in collected.messages)
    assert len(dead) == 4, dead
    assert all(error.startswith("headers:") for _, error in dead), dead
    assert {m.id for m in collected.messages}.isdisjoint({i for i, _ in dead})
