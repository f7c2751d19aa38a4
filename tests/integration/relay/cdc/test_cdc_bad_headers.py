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
from outbox_migrate.relay.claimed import HEADERS_NOT_OBJECT
from outbox_migrate.relay.options import CdcOptions, RelayOptions
from outbox_migrate.relay.worker import Relay
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
    assert all(error == HEADERS_NOT_OBJECT for _, error in dead), dead
    assert {m.id for m in collected.messages}.isdisjoint({i for i, _ in dead})
    # Out of the outbox, as polling does: marked instead, they sat in the published
    # partition, and a requeue made a second row of their id there.
    published = {r[0] for r in conn.execute("SELECT id FROM hb_published").fetchall()}
    assert published == set(collected.ids)


# SQL NULL and JSON null mean "no headers"; empty text is not JSON; nulls inside are left out.
EDGES = (None, "null", "", '{"a": null, "b": 1}', '"text"')


def _outcomes(conn: psycopg.Connection, ids: list[int], collected: Collected) -> list[object]:
    """Per row, in insertion order: the headers it was sent with, or "dead-lettered"."""
    dead = {int(r[0]) for r in conn.execute("SELECT id FROM outbox_dead_letter").fetchall()}
    sent = {m.id: dict(m.extra_headers) for m in collected.messages}
    return ["dead-lettered" if i in dead else sent.get(i, "lost") for i in ids]


def _insert_edges(conn: psycopg.Connection) -> list[int]:
    return [
        int(conn.execute(
            "INSERT INTO hb_new (payload, headers) VALUES ('{}', %s) RETURNING id", (headers,)
        ).fetchone()[0])  # type: ignore[index]
        for headers in EDGES
    ]  # fmt: skip


def test_both_delivery_styles_read_a_text_headers_column_alike(
    dsn: str, text_headers_outbox: psycopg.Connection
) -> None:
    """The same rows through the polling relay and the CDC relay: the same headers sent, the
    same rows dead-lettered. Before, the CDC relay dead-lettered a JSON null ("no headers" to
    the polling relay) and sent empty text without headers (a bad row to the polling relay)."""
    conn = text_headers_outbox
    polled, streamed = Collected(), Collected()
    ids = _insert_edges(conn)
    polling = Relay(dsn, polled.factory(), spec=SPEC,
                    options=RelayOptions(until_empty=True, listen=False))  # fmt: skip
    polling.run()
    by_polling = _outcomes(conn, ids, polled)
    conn.execute("DELETE FROM outbox_dead_letter")
    ids = _insert_edges(conn)
    relay = CdcRelay(dsn, streamed.factory(), spec=SPEC, options=CdcOptions(backoff_cap_s=0.5))
    with running(relay):
        wait_for(
            lambda: conn.execute("SELECT count(*) FROM hb_unpublished").fetchone() == (0,),
            what="every row marked",
        )
    by_cdc = _outcomes(conn, ids, streamed)
    assert by_polling == [{}, {}, "dead-lettered", {"b": "1"}, "dead-lettered"], by_polling
    assert by_cdc == by_polling
