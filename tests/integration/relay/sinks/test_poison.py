"""One poison message among many, on every sink's real broker: it reaches the dead-letter table
after `max_attempts` rejections while every other message is published (issue 16)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
import pytest

from outbox_migrate.relay.sinks import SinkConfig
from outbox_migrate.relay.worker import Relay
from outbox_migrate.testing.schema import insert_rows
from tests.integration.relay.conftest import SPEC, ids_in
from tests.integration.relay.sinks.test_brokers import assert_exactly, relay_to

pytestmark = pytest.mark.newest_pg_only
COUNT = 100
BIG = 2 * 1024 * 1024
"""Over Kafka's and NATS's default 1 MB message limits."""
FAST = {"backoff_base_s": 0.01, "backoff_cap_s": 0.05, "max_attempts": 2}


def poison(conn: psycopg.Connection, *, big: bool = False, event_type: str | None = None) -> int:
    """Make the 42nd row poisonous; returns its id."""
    victim = ids_in(conn, "outbox_new")[41]
    if big:
        conn.execute(
            "UPDATE outbox_new SET payload = json_build_object('blob', repeat('x', %s)) "
            "WHERE id = %s",
            (BIG, victim),
        )
    if event_type is not None:
        conn.execute("UPDATE outbox_new SET event_type = %s WHERE id = %s", (event_type, victim))
    return victim


def assert_dead_lettered_alone(conn: psycopg.Connection, victim: int, error: str) -> None:
    rows = conn.execute("SELECT id, attempts, last_error FROM outbox_dead_letter").fetchall()
    assert [(r[0], r[1]) for r in rows] == [(victim, 2)], rows
    assert error in rows[0][2], rows[0][2]
    assert ids_in(conn, "outbox_unpublished") == []


@pytest.mark.broker("kafka")
def test_kafka_a_2mb_message_is_dead_lettered_and_the_other_99_are_published(
    dsn: str, partitioned: psycopg.Connection, kafka_bootstrap: str
) -> None:
    """Issue 16: the old sink turned MSG_SIZE_TOO_LARGE into a worker failure (exit 2, 0 of 100
    published, the same again after every restart)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = poison(partitioned, big=True)
    topic = f"om-poison-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)
    relay = relay_to(
        dsn, "kafka", SinkConfig(url=kafka_bootstrap, target=topic, timeout_s=30), **FAST
    )
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"om-{topic}"})
    received: list[int] = []
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 60
        while len(received) < COUNT - 1 and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and not msg.error():
                received.append(int(dict(msg.headers())["outbox-id"]))
    finally:
        consumer.close()
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    assert_exactly(sorted(set(received)), expected)
    assert relay.stats.published == COUNT - 1 and relay.stats.dead_lettered == 1
    assert_dead_lettered_alone(partitioned, victim, "MSG_SIZE_TOO_LARGE")


def _nats_ids(nats_url: str, stream: str) -> list[int]:
    import nats

    async def read() -> list[int]:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(stream)
            ids = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                ids.append(int((await js.get_msg(stream, seq)).headers["outbox-id"]))
            await js.delete_stream(stream)
            return ids
        finally:
            await nc.close()

    return asyncio.run(read())


@pytest.mark.broker("nats")
def test_nats_a_payload_over_max_payload_is_dead_lettered_the_rest_published(
    dsn: str, partitioned: psycopg.Connection, nats_url: str
) -> None:
    """The old sink reported MaxPayloadError as "sink unavailable" and retried it for ever."""
    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = poison(partitioned, big=True)
    subject = f"om.poison.{uuid.uuid4().hex[:8]}"
    stream = f"OMP{uuid.uuid4().hex[:8]}"
    relay = relay_to(
        dsn, "nats", SinkConfig(url=nats_url, target=subject, extra={"stream": stream}), **FAST
    )
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    assert_exactly(_nats_ids(nats_url, stream), expected)
    assert relay.stats.published == COUNT - 1 and relay.stats.sink_failures == 0
    assert_dead_lettered_alone(partitioned, victim, "MaxPayloadError")


@pytest.mark.broker("nats")
def test_nats_no_stream_for_the_subject_rejects_instead_of_retrying_for_ever(
    dsn: str, partitioned: psycopg.Connection, nats_url: str
) -> None:
    insert_rows(partitioned, "outbox_new", 5, spec=SPEC)
    subject = f"om.nostream.{uuid.uuid4().hex[:8]}"
    relay = relay_to(
        dsn, "nats",
        SinkConfig(url=nats_url, target=subject, extra={"create_stream": "false"}), **FAST,
    )  # fmt: skip
    assert relay.stats.dead_lettered == 5 and relay.stats.sink_failures == 0
    errors = partitioned.execute("SELECT DISTINCT last_error FROM outbox_dead_letter").fetchall()
    assert len(errors) == 1 and "NoStreamResponseError" in errors[0][0]


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[object]:
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.mark.broker("redis")
def test_redis_wrongtype_on_one_routed_stream_dead_letters_only_its_message(
    dsn: str, partitioned: psycopg.Connection, redis_url: str, redis_client
) -> None:
    """`{event_type}` in the stream key routes the poison message to a key that holds a string:
    WRONGTYPE refuses it alone (the old sink made the whole batch "unavailable" for ever)."""
    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = poison(partitioned, event_type="poison")
    prefix = f"om-poison-{uuid.uuid4().hex[:8]}"
    redis_client.set(f"{prefix}.poison", "not a stream")
    try:
        relay = relay_to(
            dsn, "redis", SinkConfig(url=redis_url, target=prefix + ".{event_type}"), **FAST
        )
        received = [int(f[b"id"]) for _, f in redis_client.xrange(f"{prefix}.event")]
    finally:
        redis_client.delete(f"{prefix}.poison", f"{prefix}.event")
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    assert_exactly(received, expected)
    assert relay.stats.sink_failures == 0
    assert_dead_lettered_alone(partitioned, victim, "WRONGTYPE")


@pytest.mark.broker("rabbitmq")
def test_rabbitmq_one_unroutable_message_among_100_is_dead_lettered(
    dsn: str, partitioned: psycopg.Connection, rabbitmq_url: str
) -> None:
    import pika

    from tests.integration.relay.sinks.test_brokers import read_queue

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = poison(partitioned, event_type="poison")
    exchange = f"om-poison-{uuid.uuid4().hex[:8]}"
    queue = f"{exchange}-q"
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        channel = connection.channel()
        channel.exchange_declare(exchange, exchange_type="headers")
        channel.queue_declare(queue)
        channel.queue_bind(queue, exchange, arguments={"x-match": "all", "event-type": "event"})
        relay = relay_to(
            dsn, "rabbitmq",
            SinkConfig(url=rabbitmq_url, target="-", extra={"exchange": exchange}), **FAST,
        )  # fmt: skip
        channel.exchange_delete(exchange)
    finally:
        connection.close()
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    assert_exactly(sorted(i for i, _ in read_queue(rabbitmq_url, queue)), expected)
    assert relay.stats.published == COUNT - 1
    assert_dead_lettered_alone(partitioned, victim, "NO_ROUTE")


@pytest.mark.broker("rabbitmq")
def test_rabbitmq_a_message_over_max_message_size_is_dead_lettered_not_an_outage(
    dsn: str, partitioned: psycopg.Connection, small_rabbitmq_url: str
) -> None:
    """A body over the broker's max_message_size closes the channel (406). The sink used to
    report that as "sink unavailable" for the whole batch and retry it for ever: one row
    stopped the outbox. The test's own node has a 64 KiB limit (conftest.small_rabbitmq_url)."""
    from tests.integration.relay.sinks.conftest import SMALL_RABBITMQ_MAX_MESSAGE_SIZE
    from tests.integration.relay.sinks.test_brokers import read_queue

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = ids_in(partitioned, "outbox_new")[41]
    partitioned.execute(
        "UPDATE outbox_new SET payload = json_build_object('blob', repeat('x', %s)) WHERE id = %s",
        (SMALL_RABBITMQ_MAX_MESSAGE_SIZE + 1000, victim),
    )
    queue = f"om-too-large-{uuid.uuid4().hex[:8]}"
    config = SinkConfig(url=small_rabbitmq_url, target=queue)
    done: list[Relay] = []
    runner = threading.Thread(
        target=lambda: done.append(relay_to(dsn, "rabbitmq", config, batch_size=50, **FAST)),
        daemon=True,
    )
    runner.start()
    runner.join(timeout=60)  # the old sink retried the batch for ever: --until-empty never ends
    assert done, "the relay is still retrying the batch with the too-large message"
    relay = done[0]
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    received = sorted(i for i, _ in read_queue(small_rabbitmq_url, queue))
    assert sorted(set(received)) == expected
    # Messages of the victim's batch that the broker took but had not confirmed when it closed
    # the channel are sent again (at least once); none after the victim, none twice more.
    again = {i for i in received if received.count(i) > 1}
    assert all(i < victim and received.count(i) == 2 for i in again), again
    assert relay.stats.published == COUNT - 1
    assert relay.stats.sink_failures == 0  # not an outage: no backoff, no reconnect loop
    assert_dead_lettered_alone(partitioned, victim, "max_message_size 65536")


@pytest.mark.broker("http")
def test_http_one_422_among_100_is_dead_lettered(dsn: str, partitioned: psycopg.Connection) -> None:
    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = poison(partitioned, event_type="poison")
    received: list[int] = []
    lock = threading.Lock()

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            refuse = body["event_type"] == "poison"
            if not refuse:
                with lock:
                    received.append(body["id"])
            self.send_response(422 if refuse else 204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        relay = relay_to(dsn, "http", SinkConfig(url=url), **FAST)
    finally:
        server.shutdown()
        server.server_close()
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    assert_exactly(sorted(received), expected)
    assert relay.stats.published == COUNT - 1
    assert_dead_lettered_alone(partitioned, victim, "HTTP 422")


@pytest.mark.broker("redis")
def test_key_ordering_parks_only_the_rejected_messages_key(
    dsn: str, partitioned: psycopg.Connection, redis_url: str, redis_client
) -> None:
    """Keys A, B, C interleaved; B's third message is refused (WRONGTYPE on its stream). A and
    C flow at once; B's later messages are published only once the refused one is
    dead-lettered (same transaction or later), never before it. The old relay marked them in
    the batches right after the refusal, ahead of it."""
    from outbox_migrate.relay.options import Ordering, RelayOptions
    from outbox_migrate.relay.sinks import factory
    from outbox_migrate.relay.worker import Relay, running

    insert_rows(partitioned, "outbox_new", 90, spec=SPEC)
    partitioned.execute(
        "UPDATE outbox_new SET message_key = (ARRAY['A', 'B', 'C'])[1 + (id - 1) % 3]"
    )
    b_ids = [r[0] for r in partitioned.execute(
        "SELECT id FROM outbox_new WHERE message_key = 'B' ORDER BY id"
    ).fetchall()]  # fmt: skip
    victim = b_ids[2]
    partitioned.execute("UPDATE outbox_new SET event_type = 'poison' WHERE id = %s", (victim,))
    prefix = f"om-park-{uuid.uuid4().hex[:8]}"
    redis_client.set(f"{prefix}.poison", "not a stream")
    options = RelayOptions(
        ordering=Ordering.key, batch_size=10, listen=False, poll_interval_s=0.05,
        backoff_base_s=2.0, backoff_cap_s=2.0, max_attempts=2,
    )  # fmt: skip
    config = SinkConfig(url=redis_url, target=prefix + ".{event_type}")
    relay = Relay(dsn, factory("redis", config), spec=SPEC, options=options)
    try:
        with running(relay):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                left = partitioned.execute(
                    "SELECT count(*) FROM outbox_unpublished WHERE message_key <> 'B'"
                ).fetchone()
                if left == (0,):
                    break
                time.sleep(0.02)
            # A and C are all out; B waits behind its refused message (retry due in 1-2 s).
            waiting = ids_in(partitioned, "outbox_unpublished")
            assert waiting and set(waiting) <= set(b_ids), waiting
            assert victim in waiting
            deadline = time.monotonic() + 30
            while ids_in(partitioned, "outbox_unpublished") and time.monotonic() < deadline:
                time.sleep(0.05)
        stream = [int(f[b"id"]) for _, f in redis_client.xrange(f"{prefix}.event")]
    finally:
        redis_client.delete(f"{prefix}.poison", f"{prefix}.event")
    assert_dead_lettered_alone(partitioned, victim, "WRONGTYPE")
    dead_at = partitioned.execute("SELECT dead_at FROM outbox_dead_letter").fetchone()[0]
    later_b = partitioned.execute(
        "SELECT min(published_at) FROM outbox_published WHERE message_key = 'B' AND id > %s",
        (victim,),
    ).fetchone()[0]
    others = partitioned.execute(
        "SELECT max(published_at) FROM outbox_published WHERE message_key <> 'B'"
    ).fetchone()[0]
    assert later_b >= dead_at > others
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    assert sorted(set(stream)) == expected
