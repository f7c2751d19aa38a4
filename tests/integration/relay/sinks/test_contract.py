"""The contract every sink keeps (issue 36), each case through the real relay, the sink's real
broker and a real PostgreSQL (the oldest and the newest supported), so that a faster sink —
pipelined, batched, concurrent — cannot drop a guarantee:

* delivery: every row arrives once, with the id, key, event type, headers and payload the
  relay's envelope gives it (as far as the sink's wire carries them, `Harness.carries`), and
  every row is marked published;
* refusal: a message the broker or receiver refuses for what it is goes to the dead letters,
  with the refusal as its reason, and the other messages of its batch flow;
* oversize: a message over the sink's size limit is dead-lettered after max attempts (never
  retried for ever), and the others flow;
* outage: while the broker is unreachable nothing is marked, and once it is back everything
  arrives (a broker of the test's own that it stops, or a proxy it cuts: the machine's shared
  brokers are never touched);
* ordering: under `--ordering key`, two workers, the messages of one key arrive in insert order.

What refusal, oversize and outage *are* differs per sink; each harness names it, and the test
id says which (`test_refusal[pg18-kafka:schema-invalid-record]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows
from outbox_migrate_harness.testing.server import free_port

from outbox_migrate.relay.options import Ordering, RelayOptions
from outbox_migrate.relay.sinks import SinkConfig, factory
from outbox_migrate.relay.worker import Relay, running
from tests.integration.relay.conftest import SPEC, ids_in
from tests.integration.relay.sinks.conftest import client, run_bounded
from tests.integration.relay.sinks.test_crashes import own_redis  # noqa: F401 - a fixture
from tests.integration.relay.sinks.test_outage_recovery import own_nats  # noqa: F401 - a fixture
from tests.support.tcp_proxy import TcpProxy
from tests.support.webhook import Webhook

pytestmark = [pytest.mark.pg_edges]

COUNT = 100
VICTIM_INDEX = 41
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-{:016x}-01"
KEYS = 7
"""Keys k-0 … k-6, interleaved in insert order."""
RUN_BOUND_S = 60.0
"""Time a relay with --until-empty gets: a sink that retries a refused message for ever fails."""
SINK_TIMEOUT_S = 10.0
OUTAGE_SINK_TIMEOUT_S = 2.0
"""A publish gives up this soon while the broker is away (the other cases keep the default)."""
OUTAGE_BATCH = 25
OUTAGE_BACKOFF_CAP_S = 0.5
AWAY_S = 1.5
"""How long the broker stays away once the relay has found it so (checked for spinning)."""
FAST = {"backoff_base_s": 0.01, "backoff_cap_s": 0.05, "max_attempts": 2}
MIB = 1024 * 1024
STDOUT_LIMIT_BYTES = 2000
HTTP_RECEIVER_LIMIT_BYTES = 4096
NATS_STREAM_MAX_MSG_BYTES = 4096

Record = dict[str, Any]
"""One message as the broker holds it: `id`, `payload` (text), and what else the wire carries:
`key`, `event_type`, `headers` (the row's own headers, plus `outbox-id` where there are
broker headers)."""


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Harness:
    """One sink and its broker, as the contract drives them. A case calls `config` first (it
    sets up the broker side), then runs the relay, then `read`s what the broker holds."""

    name: ClassVar[str]
    carries: ClassVar[frozenset[str]]
    """The envelope fields this sink's wire carries (beside id and payload)."""
    refusal: ClassVar[str]
    """What "refused" means for this sink (part of the test id)."""
    oversize: ClassVar[str]
    outage: ClassVar[str]

    def __init__(self, request: pytest.FixtureRequest, stack: contextlib.ExitStack) -> None:
        self.request = request
        self.stack = stack
        self.tag = uuid.uuid4().hex[:8]
        self.down: Callable[[], None] = lambda: None
        self.up: Callable[[], None] = lambda: None

    @staticmethod
    def timeout_s(case: str) -> float:
        return OUTAGE_SINK_TIMEOUT_S if case == "outage" else SINK_TIMEOUT_S

    def config(self, case: str, conn: psycopg.Connection, victim: int | None) -> SinkConfig:
        """The sink's configuration for `case`; refusal and oversize make `victim` refused
        (its row, the broker, or both) and leave the reason in `self.reason`."""
        raise NotImplementedError

    def read(self, want: set[int]) -> list[Record]:
        """Every message the broker holds for this test, in the broker's order."""
        raise NotImplementedError

    @staticmethod
    def big(conn: psycopg.Connection, victim: int, size: int) -> None:
        conn.execute(
            "UPDATE outbox_new SET payload = json_build_object('blob', repeat('x', %s)) "
            "WHERE id = %s",
            (size, victim),
        )


class Terminal:
    """Where the stdout sink writes: lines kept in order; while `full`, a write fails as on a
    full disk (ENOSPC) — stdout redirected to a file has outages too."""

    def __init__(self) -> None:
        self.full = False
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")


class StdoutHarness(Harness):
    name = "stdout"
    carries = frozenset({"key", "event_type"})  # the JSON envelope has no headers
    refusal = "non-text-payload"
    oversize = "max-message-bytes"  # stdout has no limit of its own
    outage = "disk-full"

    def config(self, case: str, conn: psycopg.Connection, victim: int | None) -> SinkConfig:
        self.terminal = Terminal()
        monkeypatch = self.request.getfixturevalue("monkeypatch")
        monkeypatch.setattr(sys, "stdout", self.terminal)
        self.down = lambda: setattr(self.terminal, "full", True)
        self.up = lambda: setattr(self.terminal, "full", False)
        if case == "refusal":
            assert victim is not None
            conn.execute(
                "ALTER TABLE outbox_new ALTER COLUMN payload TYPE bytea "
                "USING convert_to(payload::text, 'UTF8')"
            )
            conn.execute(
                "UPDATE outbox_new SET payload = '\\xfffe'::bytea WHERE id = %s", (victim,)
            )
            self.reason = "payload is not text"
        if case == "oversize":
            assert victim is not None
            self.big(conn, victim, 2 * STDOUT_LIMIT_BYTES)
            self.reason = f"over the limit of {STDOUT_LIMIT_BYTES} (--max-message-bytes)"
            return SinkConfig(max_message_bytes=STDOUT_LIMIT_BYTES)
        return SinkConfig()

    def read(self, want: set[int]) -> list[Record]:
        out = []
        for line in "".join(self.terminal.parts).splitlines():
            envelope = json.loads(line)
            out.append({
                "id": envelope["id"], "payload": json.dumps(envelope["payload"]),
                "key": envelope["key"], "event_type": envelope["event_type"],
            })  # fmt: skip
        return out


class HttpHarness(Harness):
    name = "http"
    carries = frozenset({"key", "event_type", "headers"})
    refusal = "receiver-422"
    oversize = "receiver-413"  # the HTTP sink has no limit of its own: the receiver's
    outage = "connection-refused"

    def _respond(self, body: Any) -> tuple[int, float]:
        if body["event_type"] == "poison":
            return 422, 0.0
        if len(json.dumps(body)) > HTTP_RECEIVER_LIMIT_BYTES:
            return 413, 0.0
        return 204, (0.01 if body["id"] % 5 == 0 else 0.0)  # slow ones, for other keys to pass

    def config(self, case: str, conn: psycopg.Connection, victim: int | None) -> SinkConfig:
        self.hook = self.stack.enter_context(Webhook(self._respond))
        url = self.hook.url
        if case == "outage":
            proxy = self.stack.enter_context(TcpProxy(self.hook.server.server_address[1]))
            url = f"http://127.0.0.1:{proxy.port}/hook"
            self.down, self.up = proxy.cut, proxy.restore
        if case == "refusal":
            conn.execute("UPDATE outbox_new SET event_type = 'poison' WHERE id = %s", (victim,))
            self.reason = "HTTP 422"
        if case == "oversize":
            assert victim is not None
            self.big(conn, victim, 2 * HTTP_RECEIVER_LIMIT_BYTES)
            self.reason = "HTTP 413"
        ordering = Ordering.key if case == "ordering" else Ordering.none
        return SinkConfig(url=url, timeout_s=self.timeout_s(case), extra={"retries": "1"},
                          ordering=ordering)  # fmt: skip

    def read(self, want: set[int]) -> list[Record]:
        out = []
        with self.hook.lock:
            pairs = list(zip(self.hook.bodies, self.hook.headers, strict=True))
        for body, headers in pairs:
            if self._respond(body)[0] >= 300:
                continue
            lower = {k.lower(): v for k, v in headers.items()}
            out.append({
                "id": body["id"], "payload": json.dumps(body["payload"]), "key": body["key"],
                "event_type": body["event_type"], "headers": lower,
            })  # fmt: skip
        return out


class KafkaHarness(Harness):
    name = "kafka"
    carries = frozenset({"key", "event_type", "headers"})
    refusal = "schema-invalid-record"
    oversize = "message-max-bytes"
    outage = "proxy-cut"

    def config(self, case: str, conn: psycopg.Connection, victim: int | None) -> SinkConfig:
        from confluent_kafka.admin import AdminClient, NewTopic

        from tests.integration.relay.sinks.conftest import VALIDATED_TOPIC, _tansu

        self.topic = f"om-contract-{self.tag}"
        if case == "refusal":
            self.bootstrap = self.request.getfixturevalue("kafka_validating_bootstrap")
            self.topic = VALIDATED_TOPIC  # the broker validates this topic's records only
            conn.execute(
                "UPDATE outbox_new SET payload = '{\"poison\": true}' WHERE id = %s", (victim,)
            )
            self.reason = "INVALID_RECORD"
        elif case == "outage":
            client("confluent_kafka", "kafka")
            port = free_port()
            proxy = self.stack.enter_context(TcpProxy(port))
            workdir = self.request.getfixturevalue("tmp_path")
            self.bootstrap = self.stack.enter_context(
                contextlib.contextmanager(_tansu)(workdir, port=port, advertised=proxy.port)
            )
            self.down, self.up = proxy.cut, proxy.restore
        else:
            self.bootstrap = self.request.getfixturevalue("kafka_bootstrap")
        if case == "oversize":
            assert victim is not None
            self.big(conn, victim, 2 * MIB)  # over librdkafka's message.max.bytes (1,000,000)
            self.reason = "MSG_SIZE_TOO_LARGE"
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        made = admin.create_topics([NewTopic(self.topic, num_partitions=1, replication_factor=1)])
        with contextlib.suppress(Exception):  # the validated topic may exist already
            made[self.topic].result(30)
        self.start = self._end_offset()
        return SinkConfig(url=self.bootstrap, target=self.topic, timeout_s=self.timeout_s(case))

    def _end_offset(self) -> int:
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"om-{self.tag}"})
        try:
            return int(consumer.get_watermark_offsets(TopicPartition(self.topic, 0), 30)[1])
        finally:
            consumer.close()

    def read(self, want: set[int]) -> list[Record]:
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"om-{self.tag}",
                             "enable.auto.commit": False})  # fmt: skip
        out: list[Record] = []
        try:
            consumer.assign([TopicPartition(self.topic, 0, self.start)])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                if msg is None:
                    if want <= {r["id"] for r in out}:
                        break
                    continue
                if msg.error():
                    continue
                headers = {k: _text(v) for k, v in msg.headers() or []}
                out.append({
                    "id": int(headers["outbox-id"]), "payload": msg.value().decode(),
                    "key": _text(msg.key()) if msg.key() is not None else None,
                    "event_type": headers.get("event-type"), "headers": headers,
                })  # fmt: skip
        finally:
            consumer.close()
        return out


class RabbitMQHarness(Harness):
    name = "rabbitmq"
    carries = frozenset({"event_type", "headers"})  # AMQP's routing key is the queue's
    refusal = "unroutable"
    oversize = "max-message-size"
    outage = "proxy-cut"

    def config(self, case: str, conn: psycopg.Connection, victim: int | None) -> SinkConfig:
        import pika

        url = self.url = self.request.getfixturevalue(
            "small_rabbitmq_url" if case == "oversize" else "rabbitmq_url"
        )
        self.queue = f"om-contract-{self.tag}"
        if case == "outage":
            from urllib.parse import urlsplit

            proxy = self.stack.enter_context(TcpProxy(urlsplit(url).port or 5672))
            url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/%2F"
            self.down, self.up = proxy.cut, proxy.restore
        if case == "oversize":
            from tests.integration.relay.sinks.conftest import SMALL_RABBITMQ_MAX_MESSAGE_SIZE

            assert victim is not None
            self.big(conn, victim, SMALL_RABBITMQ_MAX_MESSAGE_SIZE + 1000)
            self.reason = f"max_message_size {SMALL_RABBITMQ_MAX_MESSAGE_SIZE}"
        if case == "refusal":
            # A headers exchange routes only event type `event`: the broker returns the victim.
            conn.execute("UPDATE outbox_new SET event_type = 'poison' WHERE id = %s", (victim,))
            exchange = f"om-contract-{self.tag}"
            connection = pika.BlockingConnection(pika.URLParameters(url))
            channel = connection.channel()
            channel.exchange_declare(exchange, exchange_type="headers", auto_delete=False)
            channel.queue_declare(self.queue)
            channel.queue_bind(
                self.queue, exchange, arguments={"x-match": "all", "event-type": "event"}
            )
            connection.close()
            self.stack.callback(self._delete_exchange, exchange)
            self.reason = "NO_ROUTE"
            return SinkConfig(url=url, target="-", extra={"exchange": exchange},
                              timeout_s=self.timeout_s(case))  # fmt: skip
        return SinkConfig(url=url, target=self.queue, timeout_s=self.timeout_s(case))

    def _delete_exchange(self, exchange: str) -> None:
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            connection.channel().exchange_delete(exchange)
        finally:
            connection.close()

    def read(self, want: set[int]) -> list[Record]:
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        out: list[Record] = []
        try:
            channel = connection.channel()
            while True:
                method, properties, body = channel.basic_get(self.queue, auto_ack=True)
                if method is None:
                    break
                headers = {k: _text(v) for k, v in (properties.headers or {}).items()}
                out.append({"id": int(properties.message_id), "payload": body.decode(),
                            "event_type": properties.type, "headers": headers})  # fmt: skip
            channel.queue_delete(self.queue)
        finally:
            connection.close()
        return out


class NatsHarness(Harness):
    name = "nats"
    carries = frozenset({"event_type", "headers"})  # one subject for all: no key on the wire
    refusal = "stream-max-msg-size"
    oversize = "max-payload"
    outage = "server-killed"

    def config(self, case: str, conn: psycopg.Connection, victim: int | None) -> SinkConfig:
        if case == "outage":
            url, kill, start = self.request.getfixturevalue("own_nats")
            self.down, self.up = kill, start
        else:
            url = self.request.getfixturevalue("nats_url")
        self.url = url
        subject = f"om.contract.{self.tag}"
        self.stream = f"OM_CONTRACT_{self.tag}"
        if case == "refusal":
            # The stream takes 4 KiB at most: JetStream refuses the victim (API error 400).
            asyncio.run(self._add_stream(subject, NATS_STREAM_MAX_MSG_BYTES))
            assert victim is not None
            self.big(conn, victim, 2 * NATS_STREAM_MAX_MSG_BYTES)
            self.reason = "maximum"
        if case == "oversize":
            assert victim is not None
            self.big(conn, victim, 2 * MIB)  # over the server's max_payload (1 MiB)
            self.reason = "max_payload"
        return SinkConfig(url=url, target=subject, extra={"stream": self.stream},
                          timeout_s=self.timeout_s(case))  # fmt: skip

    async def _add_stream(self, subject: str, max_msg_size: int) -> None:
        import nats

        nc = await nats.connect(self.url)
        try:
            js = nc.jetstream()
            await js.add_stream(name=self.stream, subjects=[subject], max_msg_size=max_msg_size)
        finally:
            await nc.close()

    def read(self, want: set[int]) -> list[Record]:
        import nats

        async def read() -> list[Record]:
            nc = await nats.connect(self.url)
            try:
                js = nc.jetstream()
                info = await js.stream_info(self.stream)
                out: list[Record] = []
                for seq in range(info.state.first_seq, info.state.last_seq + 1):
                    msg = await js.get_msg(self.stream, seq)
                    headers = dict(msg.headers or {})
                    out.append({"id": int(headers["Nats-Msg-Id"]), "payload": msg.data.decode(),
                                "event_type": headers.get("event-type"), "headers": headers})  # fmt: skip
                await js.delete_stream(self.stream)
                return out
            finally:
                await nc.close()

        return asyncio.run(read())


class RedisHarness(Harness):
    name = "redis"
    carries = frozenset({"key", "event_type", "headers"})
    refusal = "wrongtype"
    oversize = "proto-max-bulk-len"
    outage = "server-killed"

    def config(self, case: str, conn: psycopg.Connection, victim: int | None) -> SinkConfig:
        import redis

        if case == "outage":
            url, kill, start = self.request.getfixturevalue("own_redis")
            self.down, self.up = kill, start
        else:
            url = self.request.getfixturevalue(
                "small_redis_url" if case == "oversize" else "redis_url"
            )
        self.url = url
        prefix = f"om-contract-{self.tag}"
        self.stream = prefix
        target = prefix
        if case == "refusal":
            # `{event_type}` routes the victim to a key that holds a string: WRONGTYPE.
            conn.execute("UPDATE outbox_new SET event_type = 'poison' WHERE id = %s", (victim,))
            target, self.stream = prefix + ".{event_type}", prefix + ".event"
            admin = redis.Redis.from_url(url)
            admin.set(f"{prefix}.poison", "not a stream")
            admin.close()
            self.stack.callback(self._delete, f"{prefix}.poison")
            self.reason = "WRONGTYPE"
        if case == "oversize":
            from tests.integration.relay.sinks.conftest import SMALL_REDIS_MAX_BULK_BYTES

            assert victim is not None
            self.big(conn, victim, 2 * SMALL_REDIS_MAX_BULK_BYTES)
            self.reason = "proto-max-bulk-len"
        return SinkConfig(url=url, target=target, timeout_s=self.timeout_s(case))

    def _delete(self, key: str) -> None:
        import redis

        admin = redis.Redis.from_url(self.url)
        admin.delete(key)
        admin.close()

    def read(self, want: set[int]) -> list[Record]:
        import redis

        admin = redis.Redis.from_url(self.url)
        try:
            entries = admin.xrange(self.stream)
        finally:
            admin.delete(self.stream)
            admin.close()
        out = []
        for _, raw in entries:
            fields = {_text(k): _text(v) for k, v in raw.items()}
            out.append({
                "id": int(fields["id"]), "payload": fields["payload"],
                "key": fields["key"] or None, "event_type": fields["event_type"] or None,
                "headers": {**fields, "outbox-id": fields["id"]},
            })  # fmt: skip
        return out


HARNESSES: tuple[type[Harness], ...] = (
    StdoutHarness, HttpHarness, KafkaHarness, RabbitMQHarness, NatsHarness, RedisHarness,
)  # fmt: skip


def _params(what: str) -> list[Any]:
    """One param per sink; the id says what the case means for it (`kafka:proxy-cut`)."""
    return [
        pytest.param(
            h,
            id=f"{h.name}:{getattr(h, what)}" if what else h.name,
            marks=pytest.mark.broker(h.name),
        )
        for h in HARNESSES
    ]


@pytest.fixture
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    with contextlib.ExitStack() as stack:
        yield request.param(request, stack)


@pytest.fixture
def outbox(partitioned: psycopg.Connection) -> psycopg.Connection:
    """COUNT rows with keys k-0 … k-6 interleaved and a headers object (a W3C `traceparent`
    unique to the row, a tenant) that the relay sends as broker headers."""
    partitioned.execute("ALTER TABLE outbox_new ADD COLUMN headers jsonb")
    add_rows(partitioned, COUNT)
    return partitioned


def add_rows(conn: psycopg.Connection, count: int) -> None:
    insert_rows(conn, "outbox_new", count, spec=SPEC)
    conn.execute(
        "UPDATE outbox_new SET message_key = 'k-' || (id %% %s), "
        "headers = jsonb_build_object('traceparent', format(%s, lpad(to_hex(id), 16, '0')), "
        "'tenant-id', 'acme') WHERE headers IS NULL",
        (KEYS, TRACEPARENT.replace("{:016x}", "%s")),
    )


def expected_rows(conn: psycopg.Connection) -> dict[int, Record]:
    rows = conn.execute(
        "SELECT id, event_type, message_key, payload::text, headers FROM outbox_new"
    ).fetchall()
    return {
        r[0]: {"id": r[0], "event_type": r[1], "key": r[2], "payload": r[3], "headers": r[4]}
        for r in rows
    }


def relay_until_empty(dsn: str, config: SinkConfig, harness: Harness, **options: Any) -> Relay:
    """Run the relay with --until-empty in a thread; fail (after stopping it) if it does not end."""
    relay = Relay(
        dsn, factory(harness.name, config), spec=SPEC,
        options=RelayOptions(**{"until_empty": True, "listen": False, "batch_size": COUNT,
                                "sink_timeout_s": SINK_TIMEOUT_S, **FAST, **options}),
    )  # fmt: skip
    return run_bounded(relay, RUN_BOUND_S)


def assert_as_enveloped(record: Record, row: Record, harness: Harness) -> None:
    """The record carries the row's payload and every field the sink's wire carries."""
    assert json.loads(record["payload"]) == json.loads(row["payload"]), record["id"]
    assert harness.carries <= record.keys(), (harness.carries, record.keys())
    for name in ("key", "event_type"):
        if name in record:
            assert record[name] == row[name], (record["id"], name, record[name])
    if "headers" in record:
        headers = record["headers"]
        assert headers["outbox-id"] == str(row["id"])
        for name, value in row["headers"].items():
            assert headers.get(name) == value, (record["id"], name, headers)


def assert_delivered_once(received: list[int], expected: list[int]) -> None:
    duplicates = sum(c - 1 for c in Counter(received).values())
    assert duplicates == 0, f"{duplicates} duplicate(s)"
    assert sorted(received) == expected


def assert_dead_lettered_alone(conn: psycopg.Connection, victim: int, reason: str) -> None:
    rows = conn.execute("SELECT id, attempts, last_error FROM outbox_dead_letter").fetchall()
    assert [(r[0], r[1]) for r in rows] == [(victim, FAST["max_attempts"])], rows
    assert reason in rows[0][2], rows[0][2]
    assert ids_in(conn, "outbox_unpublished") == []


@pytest.mark.parametrize("harness", _params(""), indirect=True)
def test_delivery(dsn: str, outbox: psycopg.Connection, harness: Harness) -> None:
    rows = expected_rows(outbox)
    config = harness.config("delivery", outbox, None)
    relay = relay_until_empty(dsn, config, harness, batch_size=30)
    records = harness.read(set(rows))
    assert_delivered_once([r["id"] for r in records], sorted(rows))
    for record in records:
        assert_as_enveloped(record, rows[record["id"]], harness)
    assert ids_in(outbox, "outbox_published") == sorted(rows)
    assert relay.stats.published == COUNT
    assert relay.stats.sink_failures == 0 and relay.stats.dead_lettered == 0


def _refused_alone(case: str, dsn: str, conn: psycopg.Connection, harness: Harness) -> None:
    """`harness` makes one message of a COUNT-message batch refused: it alone is
    dead-lettered, with the sink's reason, after max attempts; the others are delivered."""
    rows = expected_rows(conn)
    victim = sorted(rows)[VICTIM_INDEX]
    config = harness.config(case, conn, victim)
    relay = relay_until_empty(dsn, config, harness)
    expected = [i for i in sorted(rows) if i != victim]
    records = harness.read(set(expected))
    received = [r["id"] for r in records]
    # Where a broker closed the channel or connection on the victim, batch-mates it had taken
    # unconfirmed are sent again (at least once); never the victim, never a message lost.
    assert sorted(set(received)) == expected
    assert sum(c - 1 for c in Counter(received).values()) < COUNT
    for record in records:
        assert_as_enveloped(record, rows[record["id"]], harness)
    assert relay.stats.published == COUNT - 1 and relay.stats.dead_lettered == 1
    assert relay.stats.sink_failures == 0  # a refusal, never an outage
    assert_dead_lettered_alone(conn, victim, harness.reason)


@pytest.mark.parametrize("harness", _params("refusal"), indirect=True)
def test_refusal(dsn: str, outbox: psycopg.Connection, harness: Harness) -> None:
    _refused_alone("refusal", dsn, outbox, harness)


@pytest.mark.parametrize("harness", _params("oversize"), indirect=True)
def test_oversize(dsn: str, outbox: psycopg.Connection, harness: Harness) -> None:
    _refused_alone("oversize", dsn, outbox, harness)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("harness", _params("outage"), indirect=True)
def test_outage(dsn: str, outbox: psycopg.Connection, harness: Harness) -> None:
    config = harness.config("outage", outbox, None)
    relay = Relay(
        dsn, factory(harness.name, config), spec=SPEC,
        options=RelayOptions(batch_size=OUTAGE_BATCH, listen=False, poll_interval_s=0.05,
                             backoff_base_s=0.05, backoff_cap_s=OUTAGE_BACKOFF_CAP_S,
                             sink_timeout_s=OUTAGE_SINK_TIMEOUT_S),
    )  # fmt: skip
    stats = relay.stats
    with running(relay):
        wait_for(lambda: not ids_in(outbox, "outbox_unpublished"), 30, "the first rows")
        harness.down()
        add_rows(outbox, COUNT)
        wait_for(lambda: stats.sink_failures >= 2, 30, "the relay to find the broker away")
        failures = stats.sink_failures
        time.sleep(AWAY_S)
        # Nothing is marked while the broker is away, and the relay backs off, not spins:
        # equal jitter waits at least half the cap between attempts.
        assert len(ids_in(outbox, "outbox_published")) == COUNT
        retries = stats.sink_failures - failures
        assert retries <= AWAY_S / (OUTAGE_BACKOFF_CAP_S / 2) + 2, retries
        harness.up()
        wait_for(lambda: not ids_in(outbox, "outbox_unpublished"), 60, "publishing to resume")
    rows = expected_rows(outbox)
    records = harness.read(set(rows))
    received = [r["id"] for r in records]
    # Every row arrived; at most the batches in flight when the broker went away came twice.
    assert sorted(set(received)) == sorted(rows)
    assert sum(c - 1 for c in Counter(received).values()) <= 2 * OUTAGE_BATCH
    for record in records:
        assert_as_enveloped(record, rows[record["id"]], harness)
    assert stats.dead_lettered == 0


@pytest.mark.parametrize("harness", _params(""), indirect=True)
def test_ordering_by_key(dsn: str, outbox: psycopg.Connection, harness: Harness) -> None:
    """Two workers, small batches: each key's messages arrive in insert (id) order, while the
    keys themselves interleave as they will."""
    add_rows(outbox, 2 * COUNT)
    rows = expected_rows(outbox)
    config = harness.config("ordering", outbox, None)
    relay_until_empty(dsn, config, harness, ordering=Ordering.key, workers=2, batch_size=20)
    records = harness.read(set(rows))
    first: dict[int, str] = {}
    for record in records:
        first.setdefault(record["id"], rows[record["id"]]["key"])
    assert sorted(first) == sorted(rows)
    for key in {row["key"] for row in rows.values()}:
        arrived = [i for i, k in first.items() if k == key]
        assert arrived == sorted(arrived), f"{key} out of insert order"
