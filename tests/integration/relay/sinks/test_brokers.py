"""Every sink against its real broker: N rows in → exactly those N ids out (duplicates
counted), in id order when ordering is global. Version-independent: newest PostgreSQL only."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.relay.options import Ordering, RelayOptions
from outbox_migrate.relay.sinks import SinkConfig, factory
from outbox_migrate.relay.worker import Relay, running
from tests.integration.relay.conftest import SPEC, ids_in
from tests.support.webhook import Webhook

pytestmark = pytest.mark.newest_pg_only
COUNT = 1000
OUTAGE_S = 3.0
"""Webhook down this long in the HTTP outage test (each sink's broker away: test_contract.py).
The issue's 30-s outage runs in test_crashes.py (Redis); what is new here is the HTTP sink's
own failure path (503s until its retries are exhausted), and with the backoff capped at OUTAGE_BACKOFF_CAP_S 3 s goes
through the same states: first failure, growing delays, capped delays, recovery."""
OUTAGE_BATCH = 50
OUTAGE_BACKOFF_CAP_S = 0.5
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


def wait_until_published(conn: psycopg.Connection, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while ids_in(conn, "outbox_unpublished") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ids_in(conn, "outbox_unpublished") == []


def outage_relay(dsn: str, sink: str, config: SinkConfig) -> Relay:
    """A relay that polls fast and backs off briefly, as in test_crashes.py."""
    return Relay(
        dsn, factory(sink, config), spec=SPEC,
        options=RelayOptions(batch_size=OUTAGE_BATCH, listen=False, poll_interval_s=0.05,
                             backoff_base_s=0.05, backoff_cap_s=OUTAGE_BACKOFF_CAP_S),
    )  # fmt: skip


def assert_backed_off_during_outage(relay: Relay, conn: psycopg.Connection, marked: int) -> None:
    """Nothing was marked while the broker was away, and the relay backed off, not spun."""
    assert len(ids_in(conn, "outbox_published")) == marked
    failures = relay.stats.sink_failures
    assert 3 <= failures <= 2 * OUTAGE_S / (OUTAGE_BACKOFF_CAP_S / 2) + 10, failures


def read_queue(url: str, queue: str) -> list[tuple[int, object]]:
    """Every message of `queue` as (outbox id, properties); the queue is deleted."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        out = []
        while True:
            method, properties, _body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            out.append((int(properties.message_id), properties))
        channel.queue_delete(queue)
    finally:
        connection.close()
    return out


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
    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    queue = f"om-test-{uuid.uuid4().hex[:8]}"
    relay_to(dsn, "rabbitmq", SinkConfig(url=rabbitmq_url, target=queue))
    messages = read_queue(rabbitmq_url, queue)
    received = [outbox_id for outbox_id, _ in messages]
    assert_exactly(received, ids_in(partitioned, "outbox_new"))
    first = messages[0][1]
    assert first.headers["outbox-id"] == str(received[0])
    assert first.headers["event-type"] == first.type == "event"
    assert first.delivery_mode == 2 and first.content_type == "application/json"


@pytest.mark.broker("rabbitmq")
def test_rabbitmq_one_batch_of_thousands_is_confirmed_at_once(rabbitmq_url: str) -> None:
    """The pipelined path without the relay: one publish, every message confirmed, none lost."""
    from datetime import UTC, datetime

    from outbox_migrate.relay.message import Message
    from outbox_migrate.relay.sinks.rabbitmq import RabbitMQSink

    queue = f"om-test-{uuid.uuid4().hex[:8]}"
    now = datetime.now(UTC).isoformat()
    batch = [Message(i, "public.outbox", None, None, f'{{"n":{i}}}', now) for i in range(1, 5001)]
    sink = RabbitMQSink(SinkConfig(url=rabbitmq_url, target=queue))
    try:
        sink.publish(batch[:2500])
        sink.publish(batch[2500:])  # the same channel: delivery tags continue
    finally:
        sink.close()
    received = [outbox_id for outbox_id, _ in read_queue(rabbitmq_url, queue)]
    assert_exactly(received, [m.id for m in batch])


@pytest.mark.broker("rabbitmq")
def test_rabbitmq_unroutable_messages_are_rejected_not_marked(
    dsn: str, partitioned: psycopg.Connection, rabbitmq_url: str
) -> None:
    """Published `mandatory` to an exchange with no queue bound: the broker returns every
    message, the relay marks none of them and dead-letters them after max attempts."""
    import pika

    insert_rows(partitioned, "outbox_new", 5, spec=SPEC)
    inserted = ids_in(partitioned, "outbox_new")
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
    assert [r[0] for r in dead] == inserted
    assert ids_in(partitioned, "outbox_new") == []  # dead letters leave the outbox


@pytest.mark.broker("rabbitmq")
def test_rabbitmq_returned_messages_are_rejected_by_id_the_others_published(
    dsn: str, partitioned: psycopg.Connection, rabbitmq_url: str
) -> None:
    """A headers exchange routes only `event-type: routable`: in every batch the broker returns
    the other half, which are rejected by id (then dead-lettered) while the rest is marked."""
    import pika

    insert_rows(partitioned, "outbox_new", 40, spec=SPEC)
    partitioned.execute("UPDATE outbox_new SET event_type = 'routable' WHERE id % 2 = 0")
    ids = ids_in(partitioned, "outbox_new")
    exchange = f"om-test-{uuid.uuid4().hex[:8]}"
    queue = f"{exchange}-q"
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        channel = connection.channel()
        channel.exchange_declare(exchange, exchange_type="headers")
        channel.queue_declare(queue)
        channel.queue_bind(queue, exchange, arguments={"x-match": "all", "event-type": "routable"})
        relay = relay_to(
            dsn, "rabbitmq",
            SinkConfig(url=rabbitmq_url, target="ignored", extra={"exchange": exchange}),
            max_attempts=2, batch_size=8,
        )  # fmt: skip
        channel.exchange_delete(exchange)
    finally:
        connection.close()
    routable = [i for i in ids if i % 2 == 0]
    assert ids_in(partitioned, "outbox_new") == routable  # dead letters leave the outbox
    assert_exactly(sorted(i for i, _ in read_queue(rabbitmq_url, queue)), routable)
    assert relay.stats.published == 20
    assert relay.stats.rejected == 40 and relay.stats.dead_lettered == 20
    dead = partitioned.execute("SELECT id, last_error FROM outbox_dead_letter ORDER BY id")
    rows = dead.fetchall()
    assert [r[0] for r in rows] == [i for i in ids if i % 2]
    assert rows[0][1] == "unroutable: 312 NO_ROUTE"


@pytest.mark.broker("rabbitmq")
def test_rabbitmq_nack_makes_the_whole_batch_unavailable(rabbitmq_url: str) -> None:
    """A full queue with `x-overflow: reject-publish` nacks what does not fit: back-pressure,
    so the batch is SinkUnavailable (retried with backoff), not rejected towards dead letters."""
    import pika

    from outbox_migrate.errors import SinkUnavailable
    from outbox_migrate.relay.message import Message
    from outbox_migrate.relay.sinks.rabbitmq import RabbitMQSink

    exchange = f"om-test-{uuid.uuid4().hex[:8]}"
    queue = f"{exchange}-q"
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    channel = connection.channel()
    channel.exchange_declare(exchange, exchange_type="direct")
    channel.queue_declare(queue, arguments={"x-max-length": 3, "x-overflow": "reject-publish"})
    channel.queue_bind(queue, exchange, routing_key="full")
    config = SinkConfig(url=rabbitmq_url, target="full", extra={"exchange": exchange})
    sink = RabbitMQSink(config)
    try:
        with pytest.raises(SinkUnavailable, match=r"nacked 2 message\(s\), e.g. id 4"):
            sink.publish([Message(i, "t", None, None, "{}", time_now()) for i in range(1, 6)])
        channel.queue_purge(queue)
        sink.publish([Message(9, "t", None, None, "{}", time_now())])  # fits again
    finally:
        sink.close()
        channel.exchange_delete(exchange)
        connection.close()
    assert [i for i, _ in read_queue(rabbitmq_url, queue)] == [9]


def time_now():
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat()


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
        sink.publish(
            [Message(r[0], "public.outbox_new", r[1], r[2], r[3], r[4].isoformat()) for r in rows]
        )
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
def test_http_concurrent_posts_keep_per_key_order(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    """`--ordering key`, two workers, 8 posts in flight per sink, some requests slow: every key
    arrives in id order while other keys overtake the slow ones."""
    insert_rows(partitioned, "outbox_new", 300, spec=SPEC)
    partitioned.execute("UPDATE outbox_new SET message_key = 'k-' || (id % 7)")
    keys = dict(partitioned.execute("SELECT id, message_key FROM outbox_new").fetchall())

    def respond(body) -> tuple[int, float]:
        return 204, (0.02 if body["id"] % 5 == 0 else 0.0)

    with Webhook(respond) as hook:
        config = SinkConfig(url=hook.url, timeout_s=5, extra={"concurrency": "8"},
                            ordering=Ordering.key)  # fmt: skip
        relay_to(dsn, "http", config, ordering=Ordering.key, workers=2, batch_size=50)
    assert_exactly(sorted(hook.accepted), ids_in(partitioned, "outbox_new"))
    for key in set(keys.values()):
        arrived = [i for i in hook.arrived if keys[i] == key]
        assert arrived == sorted(arrived), f"{key} out of order"
    assert hook.max_in_flight > 1
    assert hook.arrived != sorted(hook.arrived)


@pytest.mark.broker("http")
def test_http_global_ordering_from_the_cli_stays_in_id_order(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    """The CLI tells the sink the ordering: under `--ordering global` one POST at a time."""
    import subprocess
    import sys

    insert_rows(partitioned, "outbox_new", 40, spec=SPEC)
    with Webhook(lambda body: (204, 0.01 if body["id"] % 3 == 0 else 0.0)) as hook:
        result = subprocess.run(
            [sys.executable, "-m", "outbox_migrate", "relay", "--sink", "http", "--dsn", dsn,
             "--sink-url", hook.url, "--sink-option", "concurrency=8", "--until-empty",
             "--ordering", "global", "--batch-size", "15"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert_exactly(hook.arrived, ids_in(partitioned, "outbox_new"))
    assert hook.max_in_flight == 1


@pytest.mark.broker("http")
def test_http_outage_backs_off_recovers_and_loses_nothing(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    """The webhook answers 503 for a while: retries run out, the batch is unavailable, the relay
    backs off without marking anything, and delivers everything once the webhook is back."""
    down = {"now": False}
    insert_rows(partitioned, "outbox_new", 200, spec=SPEC)
    with Webhook(lambda body: (503 if down["now"] else 204, 0.0)) as hook:
        config = SinkConfig(url=hook.url, timeout_s=2.0, extra={"retries": "1"},
                            ordering=Ordering.none)  # fmt: skip
        relay = outage_relay(dsn, "http", config)
        with running(relay):
            wait_until_published(partitioned)
            down["now"] = True
            insert_rows(partitioned, "outbox_new", 200, spec=SPEC)
            time.sleep(OUTAGE_S)
            assert_backed_off_during_outage(relay, partitioned, 200)
            down["now"] = False
            wait_until_published(partitioned)
    # The batch in flight when the webhook came back may be accepted in part (a lane's retry
    # lands after the recovery while another lane had just given up) and then re-sent whole.
    duplicates = sum(c - 1 for c in Counter(hook.accepted).values())
    assert set(hook.accepted) == set(ids_in(partitioned, "outbox_new"))
    assert duplicates <= OUTAGE_BATCH


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
