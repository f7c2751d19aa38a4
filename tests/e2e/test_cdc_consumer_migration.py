"""CDC users migrating (issue 18): a logical-replication consumer of our own on the flat
outbox's publication, through HOPER and HOPIA under live writers, relays and rolling deploys
V1..V4 (and HOPER's copy-back), on every configured server (wal_level=logical).

The consumer follows the rule `plan`'s CDC view gives (docs/patterns.md, "CDC consumers"):
an INSERT whose publication column is NULL is a new message, whatever relation it arrives on.
Every message written while the slot existed must arrive exactly once: no gap (V2's first
inserts into the partitioned table are in the stream because the catalog added the
unpublished partition to the publication before V2), no replay.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from outbox_migrate.relay.cdc import pgoutput
from tests.e2e.test_zoo import SPEC_TABLE
from tests.integration.relay.cdc.conftest import drop_slots
from tests.support.zoo import SEEDED_UNPUBLISHED, check_delivery, migrate_under_load

PUBLICATION = "dbz_outbox"
SLOT = "dbz_consumer"


def _publish_and_subscribe(conn: psycopg.Connection[Any]) -> None:
    """What a team running Debezium has before migrating: a publication of the flat outbox
    (default publish: insert, update, delete, truncate) and a pgoutput slot on it."""
    conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE outbox")
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))


CDC_TABLE = replace(SPEC_TABLE, name="cdc", after_seed=_publish_and_subscribe)


def consume(dsn: str) -> tuple[Counter[int], Counter[tuple[str, str]]]:
    """Drain the slot: (id → how many times it arrived as a new message, (event, relation) →
    count of every row event seen)."""
    messages: Counter[int] = Counter()
    events: Counter[tuple[str, str]] = Counter()
    relations: dict[int, pgoutput.Relation] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            rows = conn.execute(
                "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, 20000, "
                "'proto_version', '1', 'publication_names', %s)",
                (SLOT, PUBLICATION),
            ).fetchall()
            if not rows:
                return messages, events
            for (data,) in rows:
                message = pgoutput.decode(data)
                if isinstance(message, pgoutput.Relation):
                    relations[message.oid] = message
                elif isinstance(message, pgoutput.Insert):
                    relation = relations[message.oid]
                    row = dict(zip(relation.columns, message.values, strict=True))
                    events["INSERT", relation.name] += 1
                    if row["published_at"] is None:
                        messages[int(str(row["id"]))] += 1
                elif isinstance(message, pgoutput.Other) and message.kind in ("U", "D"):
                    oid = int.from_bytes(bytes(data[1:5]), "big")
                    events[message.kind, relations[oid].name if oid in relations else "?"] += 1


@pytest.mark.parametrize("pattern", ["hoper", "hopia"])
def test_a_cdc_consumer_sees_every_message_once_through_the_migration(
    dsn: str, pattern: str
) -> None:
    try:
        outcome, _ = migrate_under_load(dsn, CDC_TABLE, pattern)
        check_delivery(outcome, CDC_TABLE)
        time.sleep(0.5)  # the test servers commit asynchronously: let the WAL catch up
        messages, events = consume(dsn)
    finally:
        drop_slots(dsn)
    # the seeded rows were inserted before the slot existed; every later row must stream
    expected = {int(i) for i in outcome.written[SEEDED_UNPUBLISHED:]}
    streamed = set(messages)
    missing = sorted(expected - streamed)
    replayed = {i: n for i, n in messages.items() if n > 1}
    print("cdc.events", pattern, dict(events), "messages", len(messages))
    assert missing == [], f"{len(missing)} messages never reached the stream: {missing[:5]}"
    assert replayed == {}, f"{len(replayed)} messages streamed more than once"
    assert streamed <= expected, sorted(streamed - expected)[:5]
    # the stream did follow the rows: V1's inserts on the flat table, V2+ on the partition
    assert events["INSERT", "outbox"] > 0 and events["INSERT", "outbox_unpublished"] > 0
