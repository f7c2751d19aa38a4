"""`relay --mode cdc` against real brokers.

* NATS JetStream and the Kafka protocol (Tansu): N rows inserted while the relay streams → the
  same N ids on the broker, once each.
* Redis: the relay process SIGKILLed after the broker's acknowledgement and before the mark
  and slot confirmation → after a restart nothing is lost and exactly the batches acknowledged
  since the last mark (here: all three, within one mark interval) are duplicated; Redis down for 30 s → nothing marked, the slot not confirmed past the
  last acknowledged transaction, everything delivered after it comes back.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.relay.cdc.relay import CdcRelay, running
from outbox_migrate.relay.options import CdcOptions
from outbox_migrate.relay.sinks import SinkConfig, factory
from tests.integration.relay.cdc.conftest import drop_slots, slot_row, wait_for
from tests.integration.relay.conftest import SPEC, ids_in

from .crash_sink import KILL_AFTER_BATCHES
from .test_brokers import _nats_stream_ids, assert_exactly
from .test_crashes import BACKOFF_CAP_S, BROKER_DOWN_S, own_redis, stream_ids  # noqa: F401

pytestmark = pytest.mark.newest_pg_only
REPO = Path(__file__).resolve().parents[4]
TXNS = 10
TXN_ROWS = 50


@pytest.fixture
def outbox(dsn: str, partitioned: psycopg.Connection) -> Iterator[psycopg.Connection]:
    try:
        yield partitioned
    finally:
        drop_slots(dsn)


def _stream_while_inserting(
    dsn: str, conn: psycopg.Connection, sink: str, config: SinkConfig
) -> None:
    """Start the CDC relay, insert TXNS transactions (plus 4 writers of single rows), wait
    until every row is published, stop."""
    relay = CdcRelay(dsn, factory(sink, config), spec=SPEC, options=CdcOptions(batch_size=100))
    with running(relay):
        wait_for(lambda: (slot_row(conn) or (0, False))[1], what="the stream")
        for _ in range(TXNS):
            insert_rows(conn, "outbox_new", TXN_ROWS, spec=SPEC)

        def singles() -> None:
            with psycopg.connect(dsn, autocommit=True) as own:
                for _ in range(50):
                    insert_rows(own, "outbox_new", 1, spec=SPEC)

        writers = [threading.Thread(target=singles) for _ in range(4)]
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        wait_for(lambda: relay.stats.published >= TXNS * TXN_ROWS + 200, 60, "every row")


@pytest.mark.broker("nats")
def test_cdc_to_nats_jetstream(dsn: str, outbox: psycopg.Connection, nats_url: str) -> None:
    subject = f"om.cdc.{uuid.uuid4().hex[:8]}"
    _stream_while_inserting(dsn, outbox, "nats", SinkConfig(url=nats_url, target=subject))
    received, _ = _nats_stream_ids(nats_url, subject.replace(".", "_").upper())
    # Commit order, which concurrent writers make differ from id order.
    assert_exactly(received, ids_in(outbox, "outbox_new"), ordered=False)
    assert ids_in(outbox, "outbox_unpublished") == []


@pytest.mark.broker("kafka")
def test_cdc_to_kafka_protocol(dsn: str, outbox: psycopg.Connection, kafka_bootstrap: str) -> None:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"om-cdc-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)
    config = SinkConfig(url=kafka_bootstrap, target=topic, timeout_s=30)
    _stream_while_inserting(dsn, outbox, "kafka", config)
    expected = ids_in(outbox, "outbox_new")
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"om-{topic}",
                         "enable.auto.commit": False})  # fmt: skip
    received: list[int] = []
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 60
        while len(received) < len(expected) and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None or msg.error():
                continue
            received.append(int(dict(msg.headers() or [])["outbox-id"]))
    finally:
        consumer.close()
    assert_exactly(received, expected, ordered=False)


def _cli(dsn: str, sink: str, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "relay", "--mode", "cdc", "--sink", sink,
         "--dsn", dsn, "--until-empty", *more],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.broker("redis")
def test_cdc_sigkill_after_ack_before_confirm_loses_nothing(
    dsn: str, outbox: psycopg.Connection, redis_url: str
) -> None:
    stream = f"om-cdc-crash-{uuid.uuid4().hex[:8]}"
    common = ["--sink-url", redis_url, "--target", stream, "--batch-size", str(TXN_ROWS)]
    created = _cli(dsn, "redis", *common)  # creates the slot on the empty outbox
    assert created.returncode == 0, created.stderr
    for _ in range(TXNS):  # each transaction fills one batch exactly
        insert_rows(outbox, "outbox_new", TXN_ROWS, spec=SPEC)
    # A mark interval longer than the run: the three batches are acknowledged within one
    # interval, so no mark was sent when the third ack kills the process.
    crashed = _cli(
        dsn, "tests.integration.relay.sinks.crash_sink:KillAfterAck", *common, "--mark-interval",
        "10",
    )  # fmt: skip
    assert crashed.returncode == -9, crashed.stderr
    assert ids_in(outbox, "outbox_published") == []  # nothing marked, so nothing confirmed
    assert len(stream_ids(redis_url, stream)) == KILL_AFTER_BATCHES * TXN_ROWS
    restarted = _cli(dsn, "redis", *common)
    assert restarted.returncode == 0, restarted.stderr
    received = stream_ids(redis_url, stream)
    assert set(received) == set(ids_in(outbox, "outbox_new"))
    # The duplicates are exactly the batches of that one mark interval, no more.
    assert sum(c - 1 for c in Counter(received).values()) == KILL_AFTER_BATCHES * TXN_ROWS
    assert ids_in(outbox, "outbox_unpublished") == []


@pytest.mark.broker("redis")
def test_cdc_broker_down_30s_confirms_nothing_past_the_last_ack(
    dsn: str,
    outbox: psycopg.Connection,
    own_redis,  # noqa: F811
) -> None:
    url, kill, start = own_redis
    stream = "om-cdc-outage"
    options = CdcOptions(batch_size=TXN_ROWS, backoff_base_s=0.05, backoff_cap_s=BACKOFF_CAP_S)
    relay = CdcRelay(
        dsn, factory("redis", SinkConfig(url=url, target=stream, timeout_s=2.0)), spec=SPEC,
        options=options,
    )  # fmt: skip
    with running(relay):
        wait_for(lambda: (slot_row(outbox) or (0, False))[1], what="the stream")
        insert_rows(outbox, "outbox_new", 300, spec=SPEC)
        wait_for(lambda: not ids_in(outbox, "outbox_unpublished"), 30, "the first rows")
        kill()
        with outbox.transaction():
            insert_rows(outbox, "outbox_new", 300, spec=SPEC)
            # The commit record comes after this position: a slot confirmed beyond it would
            # have skipped these rows after a crash.
            before_commit = outbox.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        time.sleep(BROKER_DOWN_S)
        assert len(ids_in(outbox, "outbox_unpublished")) == 300  # nothing marked
        confirmed = outbox.execute(
            "SELECT confirmed_flush_lsn <= %s FROM pg_replication_slots "
            "WHERE slot_name = 'outbox_migrate_cdc'",
            (before_commit,),
        ).fetchone()
        assert confirmed == (True,)
        failures = relay.stats.sink_failures
        assert (
            BROKER_DOWN_S / BACKOFF_CAP_S - 2 <= failures <= 2 * BROKER_DOWN_S / BACKOFF_CAP_S + 10
        )
        start()
        wait_for(lambda: not ids_in(outbox, "outbox_unpublished"), 30, "recovery")
    received = stream_ids(url, stream)
    assert set(received) == set(ids_in(outbox, "outbox_new"))
    assert sum(c - 1 for c in Counter(received).values()) <= TXN_ROWS
