"""The relay on outboxes whose columns are not the spec's: the column roles of `OutboxSpec`.

The seed's `outbox_events` (creation time `occurred_at`, a `headers` jsonb object, `trace_id`
and `tenant_id` as metadata) could not be published at all before the roles existed: the claim
selected a hard-coded `created_at`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import RelayError
from outbox_migrate.relay.options import Mode, RelayOptions
from outbox_migrate.relay.worker import Relay

from .conftest import Collected

EVENTS = OutboxSpec(
    table="outbox_events",
    created_column="occurred_at",
    key_column="aggregate_id",
    metadata_columns=("trace_id", "tenant_id"),
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _events_table(conn: psycopg.Connection) -> None:
    conn.execute(
        """
        CREATE TABLE outbox_events (
            id bigserial PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
            event_type text NOT NULL, payload jsonb NOT NULL,
            headers jsonb NOT NULL DEFAULT '{}'::jsonb,
            occurred_at timestamptz NOT NULL DEFAULT now(), trace_id text, tenant_id text,
            published_at timestamptz, publish_attempts integer NOT NULL DEFAULT 0,
            next_attempt_at timestamptz)
        """
    )
    conn.execute(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers,"
        " trace_id, tenant_id) SELECT 'order', 'ORD-' || i, 'OrderCreated',"
        " jsonb_build_object('n', i),"
        " jsonb_build_object('schema_version', 1, 'traceparent', %s::text),"
        " CASE WHEN i %% 2 = 0 THEN 'trace-' || i END, 't-42' FROM generate_series(1, 20) i",
        (TRACEPARENT,),
    )
    conn.commit()


def _run(dsn: str, spec: OutboxSpec, collected: Collected) -> None:
    Relay(
        dsn,
        collected.factory(),
        spec=spec,
        options=RelayOptions(mode=Mode.flat, until_empty=True, listen=False, batch_size=7),
    ).run()


def test_seed_outbox_events_publishes_with_headers_and_metadata(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    _events_table(conn)
    _run(dsn, EVENTS, collected)
    assert sorted(collected.ids) == list(range(1, 21))
    by_id = {m.id: m for m in collected.messages}
    even, odd = by_id[2], by_id[3]
    assert even.key == "ORD-2" and even.event_type == "OrderCreated"
    assert even.headers()["traceparent"] == TRACEPARENT  # passes through unchanged
    assert even.headers()["schema_version"] == "1"
    assert even.headers()["trace_id"] == "trace-2"
    assert even.headers()["tenant_id"] == "t-42"
    assert "trace_id" not in odd.headers()  # a NULL metadata column sends no header
    assert even.created_at is not None
    unpublished = conn.execute(
        "SELECT count(*) FROM outbox_events WHERE published_at IS NULL"
    ).fetchone()
    assert unpublished == (0,)


def test_outbox_without_metadata_sends_no_extra_headers(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    _events_table(conn)
    _run(dsn, replace(EVENTS, metadata_columns=(), headers_column=""), collected)
    assert len(collected.ids) == 20
    assert all(m.extra_headers == () for m in collected.messages)


def test_bytea_and_text_payloads_without_a_creation_column(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    conn.execute(
        "CREATE TABLE blobs (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, body bytea NOT"
        " NULL, published_at timestamptz); INSERT INTO blobs (body) SELECT convert_to("
        "'{\"n\": ' || i || '}', 'UTF8') FROM generate_series(1, 5) i"
    )
    conn.commit()
    spec = OutboxSpec(table="blobs", payload_column="body", created_column="")
    _run(dsn, spec, collected)
    assert sorted(m.payload for m in collected.messages)[0] == '{"n": 1}'
    assert len(collected.ids) == 5


def test_a_configured_column_that_is_missing_is_named(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    _events_table(conn)
    spec = OutboxSpec(table="outbox_events")  # created_at by default: the seed has occurred_at
    with pytest.raises(RelayError, match="created_at"):
        _run(dsn, spec, collected)
    missing_headers = OutboxSpec(
        table="outbox_events", created_column="occurred_at", headers_column="no_such_column"
    )
    with pytest.raises(RelayError, match="no_such_column"):
        _run(dsn, missing_headers, collected)


def test_uuid_outbox_claims_in_order_across_shards_with_rejections(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    """Application ids: two workers split shards by the id's hash, ids arrive as text, a
    refused message is counted in a text-id attempts table and ends in the dead-letter table
    (marked, so `until_empty` ends); one worker claims in created_at order."""
    from outbox_migrate.errors import MessagesRejected
    from outbox_migrate.relay.options import DEFAULT_DEAD_LETTER_TABLE

    conn.execute(
        "CREATE TABLE outbox_u (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), "
        "message_key text, event_type text, payload jsonb NOT NULL, "
        "created_at timestamptz NOT NULL DEFAULT clock_timestamp(), published_at timestamptz);"
        "CREATE INDEX outbox_u_pending ON outbox_u (created_at, id) WHERE published_at IS NULL"
    )
    insert = (
        "INSERT INTO outbox_u (message_key, event_type, payload) SELECT 'k' || (i %% 5), 'e', "
        "jsonb_build_object('n', i) FROM generate_series(%s::int, %s::int) i"
    )
    conn.execute(insert, (1, 300))
    ids = [str(r[0]) for r in conn.execute("SELECT id FROM outbox_u ORDER BY created_at")]
    conn.commit()
    poison = ids[10]

    def fail(batch: list[Any]) -> None:
        if any(m.id == poison for m in batch):
            collected.add([m for m in batch if m.id != poison])
            raise MessagesRejected("collect", {poison: "refused"})

    spec = OutboxSpec(table="outbox_u", id_kind="application", order_column="created_at")
    options = RelayOptions(mode=Mode.flat, until_empty=True, listen=False, batch_size=7,
                           workers=2, max_attempts=2, backoff_base_s=0.01,
                           backoff_cap_s=0.05)  # fmt: skip
    Relay(dsn, collected.factory(fail), spec=spec, options=options).run()
    assert sorted(collected.ids) == sorted(i for i in ids if i != poison)
    assert collected.duplicates() == 0
    dead = conn.execute(
        f"SELECT id::text, attempts, pg_typeof(id)::text FROM {DEFAULT_DEAD_LETTER_TABLE}"
    ).fetchall()
    assert dead == [(poison, 2, "text")]
    left = conn.execute(f"SELECT count(*) FROM {DEFAULT_DEAD_LETTER_TABLE}_attempts").fetchone()
    assert left == (0,)
    assert conn.execute("SELECT count(*) FROM outbox_u WHERE published_at IS NULL").fetchone() == (
        0,
    )
    # one worker: the claim order is created_at (n ascending), not the random uuids' order
    conn.execute(insert, (301, 340))
    conn.commit()
    later = Collected()
    Relay(dsn, later.factory(), spec=spec, options=replace(options, workers=1)).run()
    assert [json.loads(m.payload)["n"] for m in later.messages] == list(range(301, 341))


def test_an_idle_relay_on_uuid_ids_sleeps(dsn: str, conn: psycopg.Connection) -> None:
    """With nothing to publish, a relay on application ids waits for its poll interval (or a
    notification) between claims instead of claiming back to back."""
    import time

    from outbox_migrate.relay.worker import running

    conn.execute(
        "CREATE TABLE outbox_u (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), "
        "payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT clock_timestamp(), "
        "published_at timestamptz);"
        "CREATE INDEX outbox_u_pending ON outbox_u (created_at, id) WHERE published_at IS NULL;"
        "INSERT INTO outbox_u (payload) VALUES ('{}')"
    )
    conn.commit()
    spec = OutboxSpec(table="outbox_u", id_kind="application", order_column="created_at")
    relay = Relay(dsn, Collected().factory(), spec=spec,
                  options=RelayOptions(mode=Mode.flat, poll_interval_s=0.5))  # fmt: skip

    def scans() -> int:
        row = conn.execute(
            "SELECT coalesce(idx_scan, 0) + coalesce(seq_scan, 0) FROM pg_stat_user_tables "
            "WHERE relname = 'outbox_u'"
        ).fetchone()
        conn.commit()
        return int(row[0]) if row else 0

    with running(relay):
        deadline = time.monotonic() + 10
        while relay.stats.published < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)  # the statistics of the claims so far reach the view
        before = scans()
        time.sleep(3.0)
        conn.execute("SELECT pg_stat_clear_snapshot()")
        time.sleep(1.5)
        after = scans()
    assert relay.stats.published == 1
    assert after - before < 40, f"{after - before} scans of the outbox in 4.5 s of idling"
