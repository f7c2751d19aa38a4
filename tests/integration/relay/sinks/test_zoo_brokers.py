"""The seed's `outbox_events` migrated by HOPIA under load, published to real brokers: every
row ever written reaches the broker with its metadata as broker headers (the headers jsonb
object's `traceparent` unchanged, the `tenant_id` column), on the Kafka protocol (Tansu),
RabbitMQ and NATS JetStream. Version-independent: newest PostgreSQL only."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest

from outbox_migrate.relay.sinks import SinkConfig, factory
from tests.e2e.test_zoo import OUTBOX_EVENTS, TRACEPARENT
from tests.support.zoo import Outcome, migrate_under_load

pytestmark = [pytest.mark.newest_pg_only, pytest.mark.slow]
Received = list[tuple[int, dict[str, str], bytes]]


def _check(outcome: Outcome, received: Received) -> None:
    assert outcome.writer_errors == [] and outcome.violations == []
    assert outcome.unpublished_left == 0
    ids = {outbox_id for outbox_id, _, _ in received}
    lost = [i for i in outcome.written if i not in ids]
    assert lost == [], f"{len(lost)} lost, e.g. {lost[:5]}"
    for outbox_id, headers, body in received:
        n = json.loads(body)["n"]
        assert headers["traceparent"] == TRACEPARENT.format(n=n), (outbox_id, headers)
        assert headers["tenant_id"] == "t-42" and headers["trace_id"] == f"trace-{n}"
        assert headers["event-type"] == "OrderCreated"


@pytest.mark.broker("kafka")
def test_outbox_events_to_kafka(dsn: str, kafka_bootstrap: str) -> None:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"om-zoo-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)
    sink = factory("kafka", SinkConfig(url=kafka_bootstrap, target=topic, timeout_s=30))
    outcome, _ = migrate_under_load(dsn, OUTBOX_EVENTS, "hopia", sink)
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"om-{topic}",
                         "enable.auto.commit": False})  # fmt: skip
    received: Received = []
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 60
        idle = 0
        while time.monotonic() < deadline and idle < 5:
            msg = consumer.poll(1.0)
            if msg is None:
                idle += 1
                continue
            if msg.error():
                continue
            idle = 0
            headers = {k: v.decode() for k, v in msg.headers() or []}
            received.append((int(headers["outbox-id"]), headers, msg.value()))
    finally:
        consumer.close()
    _check(outcome, received)


@pytest.mark.broker("rabbitmq")
def test_outbox_events_to_rabbitmq(dsn: str, rabbitmq_url: str) -> None:
    import pika

    queue = f"om-zoo-{uuid.uuid4().hex[:8]}"
    sink = factory("rabbitmq", SinkConfig(url=rabbitmq_url, target=queue))
    outcome, _ = migrate_under_load(dsn, OUTBOX_EVENTS, "hopia", sink)
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    received: Received = []
    try:
        channel = connection.channel()
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            headers = {k: str(v.decode() if isinstance(v, bytes) else v)
                       for k, v in (properties.headers or {}).items()}  # fmt: skip
            received.append((int(headers["outbox-id"]), headers, body))
        channel.queue_delete(queue)
    finally:
        connection.close()
    _check(outcome, received)


@pytest.mark.broker("nats")
def test_outbox_events_to_nats(dsn: str, nats_url: str) -> None:
    subject = f"om.zoo.{uuid.uuid4().hex[:8]}"
    config = SinkConfig(url=nats_url, target=subject)
    outcome, _ = migrate_under_load(dsn, OUTBOX_EVENTS, "hopia", factory("nats", config))
    stream = config.extra.get("stream") or subject.replace(".", "_").upper()
    _check(outcome, asyncio.run(_read_stream(nats_url, stream)))


async def _read_stream(url: str, stream: str) -> Received:
    import nats

    client: Any = await nats.connect(url)
    received: Received = []
    try:
        js = client.jetstream()
        info = await js.stream_info(stream)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(stream, seq)
            headers = dict(msg.headers or {})
            received.append((int(headers["outbox-id"]), headers, msg.data))
        await js.delete_stream(stream)
    finally:
        await client.close()
    return received
