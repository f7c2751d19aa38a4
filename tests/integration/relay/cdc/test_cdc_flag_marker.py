"""The CDC relay on an outbox whose publication marker is a flag (`sent boolean NOT NULL
DEFAULT false`, partitioned `FOR VALUES IN (false)`): it streams the unpublished partition and
marks with `sent = true`. Before, its mark set `sent = now()` and failed on every batch."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.cdc.relay import CdcRelay, running
from outbox_migrate.relay.options import CdcOptions
from tests.integration.relay.conftest import Collected

from .conftest import drop_slots, wait_for

SPEC = OutboxSpec(table="outbox_sent", partitioned_table="outbox_sent_new",
                  unpublished_partition="outbox_sent_unpublished",
                  published_partition="outbox_sent_published", published_column="sent")  # fmt: skip


@pytest.fixture
def flag_outbox(dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE outbox_sent_new (id bigint GENERATED ALWAYS AS IDENTITY, "
            "payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), "
            "sent boolean NOT NULL DEFAULT false) PARTITION BY LIST (sent); "
            "CREATE TABLE outbox_sent_unpublished PARTITION OF outbox_sent_new "
            "FOR VALUES IN (false); "
            "CREATE INDEX ON outbox_sent_unpublished (id); "
            "CREATE TABLE outbox_sent_published PARTITION OF outbox_sent_new DEFAULT"
        )
        try:
            yield conn
        finally:
            drop_slots(dsn)


def test_the_cdc_relay_marks_a_flag(
    dsn: str, flag_outbox: psycopg.Connection, collected: Collected
) -> None:
    def insert(count: int) -> None:
        for i in range(count):
            flag_outbox.execute(
                "INSERT INTO outbox_sent_new (payload) VALUES (%s)", (f'{{"n": {i}}}',)
            )

    insert(20)  # a backlog before the slot exists
    relay = CdcRelay(dsn, collected.factory(), spec=SPEC, options=CdcOptions(backoff_cap_s=0.5))

    def unpublished() -> int:
        row = flag_outbox.execute("SELECT count(*) FROM outbox_sent_unpublished").fetchone()
        return int(row[0]) if row else -1

    with running(relay):
        wait_for(lambda: len(collected.ids) >= 20, what="the backlog")
        insert(30)
        wait_for(lambda: len(collected.ids) >= 50, what="every row")
        wait_for(lambda: unpublished() == 0, what="the marks")
    states = flag_outbox.execute(
        "SELECT sent, count(*) FROM outbox_sent_published GROUP BY 1"
    ).fetchall()
    assert states == [(True, 50)]
    assert collected.duplicates() == 0
    assert relay.stats.marked == 50
