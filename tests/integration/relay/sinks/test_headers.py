"""Metadata to the broker (issue 15): every sink sets `Message.headers()` — the outbox id,
table, event type and the row's extra headers, a W3C `traceparent` unchanged — as the broker's
own headers, and `envelope=cloudevents` adds the CloudEvents 1.0 attributes in binary content
mode (Kafka `ce_`, AMQP `cloudEvents:`, HTTP and NATS `ce-`) or, for Redis, a structured-mode
JSON object. Real brokers; the messages are published by the sinks themselves."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import SinkConfig, factory

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
EXTRA = (("traceparent", TRACEPARENT), ("tenant-id", "acme"))
CREATED = datetime(2026, 5, 4, 3, 2, 1, tzinfo=UTC).isoformat()
PAYLOAD = '{"order": 7, "total": "12.50"}'


def messages() -> list[Message]:
    return [
        Message(11, "public.outbox", "OrderPlaced", "order-7", PAYLOAD, CREATED, EXTRA),
        Message(12, "public.outbox", None, None, "{}", CREATED),
    ]


def publish(sink: str, config: SinkConfig) -> None:
    built = factory(sink, config)()
    try:
        built.publish(messages())
    finally:
        built.close()


def assert_relay_headers(headers: dict[str, str], *, first: bool = True) -> None:
    if first:
        assert headers["outbox-id"] == "11" and headers["event-type"] == "OrderPlaced"
        assert headers["traceparent"] == TRACEPARENT and headers["tenant-id"] == "acme"
    else:
        assert headers["outbox-id"] == "12" and "traceparent" not in headers
    assert headers["outbox-table"] == "public.outbox"


def assert_cloudevent(attrs: dict[str, str]) -> None:
    assert attrs["specversion"] == "1.0" and attrs["id"] == "11"
    assert attrs["type"] == "OrderPlaced" and attrs["source"] == "/outbox/public.outbox"
    assert attrs["subject"] == "order-7" and attrs["time"] == "2026-05-04T03:02:01+00:00"


def prefixed(headers: dict[str, str], prefix: str) -> dict[str, str]:
    return {k[len(prefix) :]: v for k, v in headers.items() if k.startswith(prefix)}


@pytest.mark.broker("kafka")
@pytest.mark.parametrize("envelope", ["raw", "cloudevents"])
def test_kafka_headers_and_cloudevents_binary_mode(kafka_bootstrap: str, envelope: str) -> None:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"om-headers-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)
    publish("kafka", SinkConfig(url=kafka_bootstrap, target=topic, timeout_s=30,
                                extra={"envelope": envelope}))  # fmt: skip
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"om-{topic}"})
    got = []
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and not msg.error():
                got.append(msg)
    finally:
        consumer.close()
    assert len(got) == 2
    headers = [{k: v.decode() for k, v in m.headers()} for m in got]
    assert_relay_headers(headers[0])
    assert_relay_headers(headers[1], first=False)
    assert got[0].value().decode() == PAYLOAD and got[0].key() == b"order-7"
    if envelope == "cloudevents":
        assert_cloudevent(prefixed(headers[0], "ce_"))
        assert headers[0]["content-type"] == "application/json"
        assert prefixed(headers[1], "ce_")["type"] == "outbox.message"
    else:
        assert not prefixed(headers[0], "ce_")


@pytest.mark.broker("rabbitmq")
@pytest.mark.parametrize("envelope", ["raw", "cloudevents"])
def test_rabbitmq_headers_and_cloudevents_binary_mode(rabbitmq_url: str, envelope: str) -> None:
    from tests.integration.relay.sinks.test_brokers import read_queue

    queue = f"om-headers-{uuid.uuid4().hex[:8]}"
    publish("rabbitmq", SinkConfig(url=rabbitmq_url, target=queue, extra={"envelope": envelope}))
    got = read_queue(rabbitmq_url, queue)
    assert [i for i, _ in got] == [11, 12]
    props = [p for _, p in got]
    headers = [
        {k: v.decode() if isinstance(v, bytes) else v for k, v in p.headers.items()} for p in props
    ]
    assert_relay_headers(headers[0])
    assert_relay_headers(headers[1], first=False)
    assert props[0].content_type == "application/json"
    if envelope == "cloudevents":
        assert_cloudevent(prefixed(headers[0], "cloudEvents:"))
    else:
        assert not prefixed(headers[0], "cloudEvents:")


@pytest.mark.broker("nats")
@pytest.mark.parametrize("envelope", ["raw", "cloudevents"])
def test_nats_headers_and_cloudevents_binary_mode(nats_url: str, envelope: str) -> None:
    import nats

    subject = f"om.headers.{uuid.uuid4().hex[:8]}"
    stream = f"OMH{uuid.uuid4().hex[:8]}"
    publish("nats", SinkConfig(url=nats_url, target=subject,
                               extra={"stream": stream, "envelope": envelope}))  # fmt: skip

    async def read() -> list[tuple[dict[str, str], bytes]]:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            out = [await js.get_msg(stream, seq) for seq in (1, 2)]
            await js.delete_stream(stream)
            return [(dict(m.headers or {}), m.data) for m in out]
        finally:
            await nc.close()

    got = asyncio.run(read())
    assert_relay_headers(got[0][0])
    assert_relay_headers(got[1][0], first=False)
    assert got[0][0]["Nats-Msg-Id"] == "11" and got[0][1].decode() == PAYLOAD
    if envelope == "cloudevents":
        attrs = prefixed(got[0][0], "ce-")
        assert_cloudevent(attrs)
        assert attrs["datacontenttype"] == "application/json"
    else:
        assert not prefixed(got[0][0], "ce-")


@pytest.mark.broker("redis")
@pytest.mark.parametrize("envelope", ["raw", "cloudevents"])
def test_redis_fields_and_cloudevents_structured_mode(redis_url: str, envelope: str) -> None:
    import redis

    stream = f"om-headers-{uuid.uuid4().hex[:8]}"
    publish("redis", SinkConfig(url=redis_url, target=stream, extra={"envelope": envelope}))
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        entries = [fields for _, fields in client.xrange(stream)]
    finally:
        client.delete(stream)
        client.close()
    first = entries[0]
    assert first["id"] == "11" and first["traceparent"] == TRACEPARENT
    assert first["tenant-id"] == "acme" and "traceparent" not in entries[1]
    if envelope == "cloudevents":
        event = json.loads(first["payload"])
        assert_cloudevent(event)
        assert event["data"] == json.loads(PAYLOAD)
    else:
        assert first["payload"] == PAYLOAD


@pytest.mark.broker("http")
@pytest.mark.parametrize("envelope", ["json", "cloudevents"])
def test_http_headers_and_cloudevents_binary_mode(envelope: str) -> None:
    received: list[tuple[dict[str, str], bytes]] = []
    lock = threading.Lock()

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                received.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        publish("http", SinkConfig(url=url, extra={"envelope": envelope}))
    finally:
        server.shutdown()
        server.server_close()
    received.sort(key=lambda r: r[0]["x-outbox-id"])
    headers, body = received[0]
    assert_relay_headers(headers)
    assert_relay_headers(received[1][0], first=False)
    assert headers["idempotency-key"] == "11"
    if envelope == "cloudevents":
        assert_cloudevent(prefixed(headers, "ce-"))
        assert headers["content-type"] == "application/json" and body.decode() == PAYLOAD
    else:
        assert json.loads(body)["id"] == 11 and not prefixed(headers, "ce-")
