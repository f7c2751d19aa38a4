"""Every sink against its real broker: N rows in → exactly those N ids out (duplicates
counted), in id order when ordering is global. Version-independent: newest PostgreSQL only."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import psycopg
import pytest

from outbox_migrate.relay.options import Ordering, RelayOptions
from outbox_migrate.relay.sinks import SinkConfig, factory
from outbox_migrate.relay.worker import Relay
from outbox_migrate.testing.schema import insert_rows
from tests.integration.relay.conftest import SPEC, ids_in

pytestmark = pytest.mark.newest_pg_only
COUNT = 1000
DEFAULTS = {"until_empty": True, "listen": False, "batch_size": 100, "ordering": Ordering.global_}


def relay_to(dsn: str, sink: str, config: SinkConfig, **options) -> Relay:
    relay = Relay(
        dsn,
        factory(sink, config),
        spec=SPEC,
        options=RelayOptions(**{**DEFAULTS, **options}),
    )
    relay.run()
    return relay


def assert_exactly(received: list[int], expected: list[int], *, ordered: bool = True) -> None:
    duplicates = sum(c - 1 for c in Counter(received).values())
    assert duplicates == 0, f"{duplicates} duplicate(s)"
    assert sorted(received) == expected
    if ordered:
        assert received == expected


@pytest.mark.broker("redis")
def test_redis_streams(dsn: str, partitioned: psycopg.Connection, redis_url: str) -> None:
    import redis

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    stream = f"om-test-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    try:
        relay_to(dsn, "redis", SinkConfig(url=redis_url, target=stream))
        entries = client.xrange(stream)
        received = [int(fields[b"id"]) for _, fields in entries]
        first = entries[0][1]
    finally:
        client.delete(stream)
        client.close()
    assert_exactly(received, ids_in(partitioned, "outbox_new"))
    assert first[b"event_type"] == b"event" and first[b"payload"].startswith(b"{")
    assert ids_in(partitioned, "outbox_unpublished") == []


@pytest.mark.broker("rabbitmq")
def test_rabbitmq_with_publisher_confirms(
    dsn: str, partitioned: psycopg.Connection, rabbitmq_url: str
) -> None:
    import pika

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    queue = f"om-test-{uuid.uuid4().hex[:8]}"
    relay_to(dsn, "rabbitmq", SinkConfig(url=rabbitmq_url, target=queue))
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        channel = connection.channel()
        received: list[int] = []
        first_headers = None
        while True:
            method, properties, _body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            received.append(int(properties.message_id))
            first_headers = first_headers or properties.headers
        channel.queue_delete(queue)
    finally:
        connection.close()
    assert_exactly(received, ids_in(partitioned, "outbox_new"))
    assert first_headers is not None and first_headers["outbox-id"] == str(received[0])


@pytest.mark.broker("rabbitmq")
def test_rabbitmq_unroutable_messages_are_rejected_not_marked(
    dsn: str, partitioned: psycopg.Connection, rabbitmq_url: str
) -> None:
    """Published `mandatory` to an exchange with no queue bound: the broker returns every
    message, the relay marks none of them and dead-letters them after max attempts."""
    import pika

    insert_rows(partitioned, "outbox_new", 5, spec=SPEC)
    exchange = f"om-test-{uuid.uuid4().hex[:8]}"
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        connection.channel().exchange_declare(exchange, exchange_type="direct")
        relay = relay_to(
            dsn, "rabbitmq",
            SinkConfig(url=rabbitmq_url, target="nowhere", extra={"exchange": exchange}),
            max_attempts=2,
        )  # fmt: skip
        connection.channel().exchange_delete(exchange)
    finally:
        connection.close()
    assert relay.stats.rejected == 10
    assert relay.stats.dead_lettered == 5
    assert relay.stats.published == 0
    dead = partitioned.execute("SELECT id FROM outbox_dead_letter ORDER BY id").fetchall()
    assert [r[0] for r in dead] == ids_in(partitioned, "outbox_new")


def _nats_stream_ids(nats_url: str, stream: str) -> tuple[list[int], dict[str, str]]:
    import nats

    async def read() -> tuple[list[int], dict[str, str]]:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(stream)
            ids: list[int] = []
            headers: dict[str, str] = {}
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await js.get_msg(stream, seq)
                ids.append(int(msg.headers["Nats-Msg-Id"]))
                headers = headers or dict(msg.headers)
            await js.delete_stream(stream)
            return ids, headers
        finally:
            await nc.close()

    return asyncio.run(read())


@pytest.mark.broker("nats")
def test_nats_jetstream_deduplicates_on_outbox_id(
    dsn: str, partitioned: psycopg.Connection, nats_url: str
) -> None:
    from outbox_migrate.relay.message import Message
    from outbox_migrate.relay.sinks.nats import NatsSink

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    subject = f"om.test.{uuid.uuid4().hex[:8]}"
    config = SinkConfig(url=nats_url, target=subject)
    relay_to(dsn, "nats", config)
    # Re-send the first 100 rows, as a relay killed before its mark would: JetStream drops them.
    rows = partitioned.execute(
        "SELECT id, event_type, message_key, payload::text, created_at FROM outbox_new "
        "ORDER BY id LIMIT 100"
    ).fetchall()
    sink = NatsSink(config)
    try:
        sink.publish([Message(r[0], "public.outbox_new", r[1], r[2], r[3], r[4]) for r in rows])
    finally:
        sink.close()
    assert sink.duplicates == 100
    received, headers = _nats_stream_ids(nats_url, config.extra.get("stream") or
                                         subject.replace(".", "_").upper())  # fmt: skip
    assert_exactly(received, ids_in(partitioned, "outbox_new"))
    assert headers["event-type"] == "event"


@pytest.mark.broker("kafka")
def test_kafka_protocol_tansu(
    dsn: str, partitioned: psycopg.Connection, kafka_bootstrap: str
) -> None:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    topic = f"om-test-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)
    relay_to(dsn, "kafka", SinkConfig(url=kafka_bootstrap, target=topic, timeout_s=30))
    consumer = Consumer({
        "bootstrap.servers": kafka_bootstrap, "group.id": f"om-{topic}",
        "enable.auto.commit": False,
    })  # fmt: skip
    received: list[int] = []
    keys: list[bytes] = []
    try:
        # Read the partition directly (assign, no group coordination: Tansu's groups are slow).
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 60
        while len(received) < COUNT and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None or msg.error():
                continue
            headers = dict(msg.headers() or [])
            received.append(int(headers["outbox-id"]))
            keys.append(msg.key())
    finally:
        consumer.close()
    assert_exactly(received, ids_in(partitioned, "outbox_new"))
    assert all(k.startswith(b"k-") for k in keys)


@pytest.mark.broker("http")
def test_http_webhook_with_retries(dsn: str, partitioned: psycopg.Connection) -> None:
    """A real HTTP server that fails every third request with 503: the sink retries them."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    pytest.importorskip("httpx")
    insert_rows(partitioned, "outbox_new", 120, spec=SPEC)
    received: list[int] = []
    lock = threading.Lock()
    counter = {"n": 0}

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                counter["n"] += 1
                fail = counter["n"] % 3 == 0
                if not fail:
                    envelope = json.loads(body)
                    assert envelope["id"] == int(self.headers["Idempotency-Key"])
                    received.append(envelope["id"])
            self.send_response(503 if fail else 204)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        relay = relay_to(dsn, "http", SinkConfig(url=url, timeout_s=5), batch_size=20)
    finally:
        server.shutdown()
        server.server_close()
    assert_exactly(received, ids_in(partitioned, "outbox_new"))
    assert counter["n"] > 120  # the 503s were retried
    assert relay.stats.sink_failures == 0


@pytest.mark.broker("http")
def test_http_4xx_is_a_permanent_rejection(dsn: str, partitioned: psycopg.Connection) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    pytest.importorskip("httpx")
    insert_rows(partitioned, "outbox_new", 3, spec=SPEC)

    class Refuse(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(422)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        relay = relay_to(dsn, "http", SinkConfig(url=url), max_attempts=2)
    finally:
        server.shutdown()
        server.server_close()
    assert relay.stats.dead_lettered == 3
    row = partitioned.execute("SELECT count(*), min(last_error) FROM outbox_dead_letter").fetchone()
    assert row == (3, "HTTP 422")


@pytest.mark.broker("nats")
def test_cli_nats_with_sink_options(
    dsn: str, partitioned: psycopg.Connection, nats_url: str
) -> None:
    import subprocess
    import sys

    insert_rows(partitioned, "outbox_new", 30, spec=SPEC)
    subject = f"om.cli.{uuid.uuid4().hex[:8]}"
    stream = f"OM_CLI_{uuid.uuid4().hex[:8]}"
    result = subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "relay", "--sink", "nats", "--dsn", dsn,
         "--sink-url", nats_url, "--target", subject, "--sink-option", f"stream={stream}",
         "--until-empty", "--ordering", "global", "--batch-size", "7"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    received, _headers = _nats_stream_ids(nats_url, stream)
    assert_exactly(received, ids_in(partitioned, "outbox_new"))
