"""A message the broker refuses is a bad message, never an outage (issue 26), on real brokers:
the sink names it (or finds it by re-sending its batch in halves), it reaches the dead-letter
table, and the other messages of its batch are delivered; a message over the size limit is
rejected before it is sent. One refusal and one oversize message per sink are test_contract.py's;
here the paths particular to one broker or option."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.relay.options import RelayOptions
from outbox_migrate.relay.sinks import SinkConfig, factory
from outbox_migrate.relay.worker import Relay, running
from tests.integration.relay.conftest import SPEC, ids_in
from tests.integration.relay.sinks.conftest import run_bounded
from tests.integration.relay.sinks.test_brokers import DEFAULTS, assert_exactly

pytestmark = pytest.mark.newest_pg_only
COUNT = 100
FAST = {"backoff_base_s": 0.01, "backoff_cap_s": 0.05, "max_attempts": 2}
BOUND_S = 60.0
"""Time a relay with --until-empty gets; the old sinks retried the refused batch for ever."""


def relay_bounded(dsn: str, sink: str, config: SinkConfig, **options: object) -> Relay:
    """Run a relay until empty, in a thread; fail (after stopping it) if it does not end."""
    relay = Relay(
        dsn, factory(sink, config), spec=SPEC,
        options=RelayOptions(**{**DEFAULTS, **FAST, **options}),  # type: ignore[arg-type]
    )  # fmt: skip
    return run_bounded(relay, BOUND_S)


def assert_dead_lettered_alone(conn: psycopg.Connection, victim: int, error: str) -> None:
    rows = conn.execute("SELECT id, attempts, last_error FROM outbox_dead_letter").fetchall()
    assert [(r[0], r[1]) for r in rows] == [(victim, 2)], rows
    assert error in rows[0][2], rows[0][2]
    assert ids_in(conn, "outbox_unpublished") == []


def last_error(conn: psycopg.Connection) -> str:
    row = conn.execute("SELECT last_error FROM outbox_dead_letter").fetchone()
    return "" if row is None else str(row[0])


def kafka_ids(bootstrap: str, topic: str, count: int) -> list[int]:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"om-{topic}-{time.time()}"})
    received: list[int] = []
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 30
        while len(received) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                received.append(int(dict(msg.headers())["outbox-id"]))
    finally:
        consumer.close()
    return received


def redis_ids(url: str, stream: str) -> list[int]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return [int(fields[b"id"]) for _, fields in client.xrange(stream)]
    finally:
        client.delete(stream)
        client.close()


def big_victim(conn: psycopg.Connection, size: int) -> int:
    """Give the 42nd row a payload of about `size` bytes; returns its id."""
    victim = ids_in(conn, "outbox_new")[41]
    conn.execute(
        "UPDATE outbox_new SET payload = json_build_object('blob', repeat('x', %s)) WHERE id = %s",
        (size, victim),
    )
    return victim


@pytest.mark.broker("redis")
def test_redis_without_config_a_dropped_connection_is_traced_to_its_message(
    dsn: str, partitioned: psycopg.Connection, small_redis_url: str
) -> None:
    """Where CONFIG is refused (managed Redis) the limit is unknown: the dropped connection is
    recognised (Redis still answers PING) and the batch re-sent in halves finds the message."""
    from tests.integration.relay.sinks.conftest import NO_CONFIG_USER, SMALL_REDIS_MAX_BULK_BYTES

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = big_victim(partitioned, 2 * SMALL_REDIS_MAX_BULK_BYTES)
    stream = f"om-dropped-{time.time_ns()}"
    url = small_redis_url.replace("redis://", f"redis://{NO_CONFIG_USER}:x@")
    relay = relay_bounded(dsn, "redis", SinkConfig(url=url, target=stream))
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    # XADDs that ran before a drop are added again when their half is re-sent (at least once).
    assert sorted(set(redis_ids(small_redis_url, stream))) == expected
    assert relay.stats.published == COUNT - 1 and relay.stats.sink_failures == 0
    # Redis drops the connection after the bulk's length; whether its "-ERR Protocol error"
    # reply is read before the drop is a race, and either names the message.
    reason = "dropped the connection" if "dropped" in last_error(partitioned) else "Protocol error"
    assert_dead_lettered_alone(partitioned, victim, reason)


@pytest.mark.broker("redis")
def test_redis_out_of_memory_is_an_outage_not_a_bad_message(
    dsn: str, partitioned: psycopg.Connection, small_redis_url: str
) -> None:
    """A Redis at its maxmemory (noeviction) answers every XADD with `OOM …`: the server's
    state, not the message's. redis-py hands that reply over as an `OutOfMemoryError` whose
    text has lost its `OOM` code; read by its text, every message was dead-lettered. The
    relay must back off and deliver everything once Redis has room again."""
    import redis

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    stream = f"om-oom-{time.time_ns()}"
    admin = redis.Redis.from_url(small_redis_url)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")
    relay = Relay(
        dsn, factory("redis", SinkConfig(url=small_redis_url, target=stream)), spec=SPEC,
        options=RelayOptions(batch_size=10, listen=False, poll_interval_s=0.05,
                             backoff_base_s=0.05, backoff_cap_s=0.2, max_attempts=2),
    )  # fmt: skip
    try:
        with running(relay):
            _poll(lambda: relay.stats.sink_failures >= 3, "three failed publishes")
            assert dead_letter_count(partitioned) == 0
            assert len(ids_in(partitioned, "outbox_published")) == 0
            admin.config_set("maxmemory", "0")
            _poll(lambda: not ids_in(partitioned, "outbox_unpublished"), "the outbox drained")
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()
    assert sorted(set(redis_ids(small_redis_url, stream))) == ids_in(partitioned, "outbox_new")
    assert dead_letter_count(partitioned) == 0


def dead_letter_count(conn: psycopg.Connection) -> int:
    """Rows in the dead-letter table; 0 while the relay has not made one."""
    if conn.execute("SELECT to_regclass('outbox_dead_letter')").fetchone() == (None,):
        return 0
    row = conn.execute("SELECT count(*) FROM outbox_dead_letter").fetchone()
    assert row is not None
    return int(row[0])


def _poll(condition: Callable[[], object], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.05)


LIMIT_BYTES = 2000
"""--max-message-bytes of the next test: far below every broker's own limit, so each broker
would take the victim's 5 KB body; only the relay's option refuses it."""


def _publish_with_limit(
    sink: str, request: pytest.FixtureRequest, dsn: str
) -> tuple[Relay, list[int]]:
    """Run the relay with --max-message-bytes to `sink`'s real broker; the ids it received."""
    import uuid

    name = f"om-limit-{uuid.uuid4().hex[:8]}"
    options = {"max_message_bytes": LIMIT_BYTES}
    if sink == "kafka":
        from confluent_kafka.admin import AdminClient, NewTopic

        bootstrap = request.getfixturevalue("kafka_bootstrap")
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])[name].result(
            30
        )
        config = SinkConfig(url=bootstrap, target=name, max_message_bytes=LIMIT_BYTES)
        relay = relay_bounded(dsn, sink, config, **options)
        return relay, kafka_ids(bootstrap, name, COUNT - 1)
    if sink == "rabbitmq":
        from tests.integration.relay.sinks.test_brokers import read_queue

        url = request.getfixturevalue("rabbitmq_url")
        config = SinkConfig(url=url, target=name, max_message_bytes=LIMIT_BYTES)
        relay = relay_bounded(dsn, sink, config, **options)
        return relay, [i for i, _ in read_queue(url, name)]
    if sink == "nats":
        from tests.integration.relay.sinks.test_poison import _nats_ids

        url = request.getfixturevalue("nats_url")
        stream = name.replace("-", "_").upper()
        config = SinkConfig(
            url=url, target=name.replace("-", "."), extra={"stream": stream},
            max_message_bytes=LIMIT_BYTES,
        )  # fmt: skip
        relay = relay_bounded(dsn, sink, config, **options)
        return relay, _nats_ids(url, stream)
    if sink == "redis":
        url = request.getfixturevalue("redis_url")
        config = SinkConfig(url=url, target=name, max_message_bytes=LIMIT_BYTES)
        relay = relay_bounded(dsn, sink, config, **options)
        return relay, redis_ids(url, name)
    if sink == "http":
        from tests.support.webhook import Webhook

        with Webhook() as hook:
            config = SinkConfig(url=hook.url, max_message_bytes=LIMIT_BYTES)
            relay = relay_bounded(dsn, sink, config, **options)
        return relay, hook.accepted
    raise AssertionError(f"no broker for {sink}")  # stdout's limit is test_contract.py's


@pytest.mark.parametrize(
    "sink",
    [
        pytest.param(name, marks=pytest.mark.broker(name))
        for name in ("kafka", "rabbitmq", "nats", "redis", "http")
    ],
)
def test_max_message_bytes_rejects_a_larger_message_before_sending(
    sink: str, request: pytest.FixtureRequest, dsn: str, partitioned: psycopg.Connection
) -> None:
    """The broker would take the 5 KB message; `--max-message-bytes 2000` refuses it before
    it is sent (the broker never sees it), and the other 99 are published."""
    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = big_victim(partitioned, 5000)
    relay, received = _publish_with_limit(sink, request, dsn)
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    assert sorted(received) == expected
    assert relay.stats.published == COUNT - 1 and relay.stats.sink_failures == 0
    assert_dead_lettered_alone(partitioned, victim, f"of {LIMIT_BYTES} (--max-message-bytes)")


def server_max_payload(nats_url: str) -> int:
    import asyncio

    import nats

    async def read() -> int:
        nc = await nats.connect(nats_url)
        try:
            return int(nc.max_payload)
        finally:
            await nc.close()

    return asyncio.run(read())


@pytest.mark.broker("nats")
def test_nats_body_and_headers_over_max_payload_is_rejected_before_sending(
    dsn: str, partitioned: psycopg.Connection, nats_url: str
) -> None:
    """A body just under the server's max_payload passes nats-py's own check (the body alone),
    but the server counts the headers too: it closed the connection, every publish of the
    batch timed out, and the old sink retried the batch for ever."""
    from tests.integration.relay.sinks.test_poison import _nats_ids

    limit = server_max_payload(nats_url)
    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = big_victim(partitioned, limit)
    # Make the stored JSON text exactly 10 bytes under the limit, whatever the column renders.
    size = partitioned.execute(
        "SELECT octet_length(payload::text) FROM outbox_new WHERE id = %s", (victim,)
    ).fetchone()[0]
    big_victim(partitioned, limit - (size - limit) - 10)
    size = partitioned.execute(
        "SELECT octet_length(payload::text) FROM outbox_new WHERE id = %s", (victim,)
    ).fetchone()[0]
    assert size == limit - 10
    name = f"om.maxpayload.{time.time_ns()}"
    stream = name.replace(".", "_").upper()
    config = SinkConfig(url=nats_url, target=name, extra={"stream": stream}, timeout_s=5)
    relay = relay_bounded(dsn, "nats", config)
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    assert_exactly(_nats_ids(nats_url, stream), expected)
    assert relay.stats.published == COUNT - 1 and relay.stats.sink_failures == 0
    assert_dead_lettered_alone(partitioned, victim, "max_payload, headers included")


@pytest.mark.broker("rabbitmq")
def test_rabbitmq_an_event_type_amqp_cannot_carry_is_rejected_not_an_outage(
    dsn: str, partitioned: psycopg.Connection, rabbitmq_url: str
) -> None:
    """AMQP's `type` property is a short string (255 bytes): pika raised ShortStringTooLong
    while encoding the batch, and the old sink called that an outage and retried for ever."""
    from tests.integration.relay.sinks.test_brokers import read_queue

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = ids_in(partitioned, "outbox_new")[41]
    partitioned.execute(
        "UPDATE outbox_new SET event_type = repeat('é', 200) WHERE id = %s", (victim,)
    )  # 200 characters, 400 bytes
    queue = f"om-shortstr-{time.time_ns()}"
    relay = relay_bounded(dsn, "rabbitmq", SinkConfig(url=rabbitmq_url, target=queue))
    expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
    assert sorted(i for i, _ in read_queue(rabbitmq_url, queue)) == expected
    assert relay.stats.published == COUNT - 1 and relay.stats.sink_failures == 0
    assert_dead_lettered_alone(partitioned, victim, "event type of 400 bytes")


@pytest.mark.broker("kafka")
def test_kafka_a_refused_record_is_found_when_the_search_outlives_the_sink_timeout(
    dsn: str, partitioned: psycopg.Connection, request: pytest.FixtureRequest
) -> None:
    """The broker refuses the record batch for one record; each half sent again needs a fresh
    producer (about half a second on Tansu), and the search for the record takes longer than
    `--sink-timeout 5`. Each publish now marks what its halves delivered, so the next one
    searches fewer: the record is dead-lettered and the rest published. Before, every retry
    began again from the whole batch and ran out of time the same way: nothing published,
    for ever. (With a timeout that fits only a round or two the search still cannot finish.)"""
    import contextlib
    import dataclasses

    from tests.integration.relay.sinks.test_contract import KafkaHarness

    insert_rows(partitioned, "outbox_new", COUNT, spec=SPEC)
    victim = ids_in(partitioned, "outbox_new")[41]
    with contextlib.ExitStack() as stack:
        harness = KafkaHarness(request, stack)
        config = dataclasses.replace(harness.config("refusal", partitioned, victim), timeout_s=5.0)
        relay = relay_bounded(dsn, "kafka", config, batch_size=COUNT, sink_timeout_s=5.0)
        expected = [i for i in ids_in(partitioned, "outbox_new") if i != victim]
        received = [r["id"] for r in harness.read(set(expected))]
    assert sorted(set(received)) == expected
    assert relay.stats.published == COUNT - 1 and relay.stats.dead_lettered == 1
    assert relay.stats.sink_failures >= 1  # the search did outlive a publish's time
    assert_dead_lettered_alone(partitioned, victim, "INVALID_RECORD")
