"""A payload that is bytes, not text (a non-UTF-8 bytea row), on every sink's real broker: sent
byte for byte where the body is bytes, rejected under its id — never an outage, never mangled —
where a JSON envelope or a text line must carry it. The messages are built by hand: the claim
that yields bytes payloads is the relay's side of the contract, not the sinks'."""

from __future__ import annotations

import uuid

import pytest

from outbox_migrate.errors import MessagesRejected
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import Sink, SinkConfig, factory

pytestmark = pytest.mark.newest_pg_only
RAW = b"\xff\xfe\x00not utf-8\x80"
CREATED = "2026-11-26T12:00:00+00:00"


def messages() -> list[Message]:
    return [
        Message(1, "public.outbox_new", "event", "k", '{"n": 1}', CREATED),
        Message(2, "public.outbox_new", "event", "k", RAW, CREATED),  # type: ignore[arg-type]
        Message(3, "public.outbox_new", "event", "k", '{"n": 3}', CREATED),
    ]


def publish(sink: Sink) -> dict[object, str]:
    """Publish the three messages; the rejected ids with their reasons ({} = all taken)."""
    try:
        sink.publish(messages())
    except MessagesRejected as exc:
        return exc.rejected
    finally:
        sink.close()
    return {}


def build(name: str, request: pytest.FixtureRequest, envelope: str) -> tuple[Sink, object]:
    """The sink and what the test needs to read back from its broker."""
    target = f"om-bin-{uuid.uuid4().hex[:8]}"
    extra = {"envelope": envelope}
    if name == "kafka":
        from confluent_kafka.admin import AdminClient, NewTopic

        url = request.getfixturevalue("kafka_bootstrap")
        admin = AdminClient({"bootstrap.servers": url})
        admin.create_topics([NewTopic(target, 1, 1)])[target].result(30)
    elif name == "nats":
        url = request.getfixturevalue("nats_url")
        extra["stream"] = target.replace("-", "_").upper()
        target = target.replace("-", ".")
    elif name == "http":
        from tests.support.webhook import Webhook

        hook = Webhook(lambda _body: (204, 0.0))
        hook.__enter__()
        request.addfinalizer(lambda: hook.__exit__(None, None, None))
        url = hook.url
    elif name == "stdout":
        return factory(name, SinkConfig(extra=extra))(), request.getfixturevalue("capsys")
    else:
        url = request.getfixturevalue(f"{name}_url")
    sink = factory(name, SinkConfig(url=url, target=target, extra=extra, timeout_s=10))()
    return sink, (url, target, extra)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.broker(name))
        for name in ("kafka", "rabbitmq", "nats", "redis", "http", "stdout")
    ],
)
def test_a_json_envelope_rejects_a_bytes_payload_and_takes_the_rest(
    name: str, request: pytest.FixtureRequest
) -> None:
    sink, _ = build(name, request, "json")
    rejected = publish(sink)
    assert list(rejected) == [2], rejected
    assert "not text" in rejected[2]


def test_stdout_rejects_a_bytes_payload_in_any_envelope_and_writes_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for envelope in ("raw", "json", "cloudevents"):
        sink = factory("stdout", SinkConfig(extra={"envelope": envelope}))()
        assert list(publish(sink)) == [2]
        assert len(capsys.readouterr().out.splitlines()) == 2


@pytest.mark.broker("kafka")
def test_kafka_sends_a_bytes_payload_byte_for_byte(request: pytest.FixtureRequest) -> None:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    sink, (url, topic, _) = build("kafka", request, "raw")  # type: ignore[misc]
    assert publish(sink) == {}
    consumer = Consumer({"bootstrap.servers": url, "group.id": f"om-{topic}"})
    values: dict[int, bytes] = {}
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        for _ in range(60):
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                values[int(dict(msg.headers())["outbox-id"])] = msg.value()
            if len(values) == 3:
                break
    finally:
        consumer.close()
    assert values == {1: b'{"n": 1}', 2: RAW, 3: b'{"n": 3}'}


@pytest.mark.broker("redis")
def test_redis_sends_a_bytes_payload_byte_for_byte(request: pytest.FixtureRequest) -> None:
    import redis

    sink, (url, stream, _) = build("redis", request, "raw")  # type: ignore[misc]
    assert publish(sink) == {}
    client = redis.Redis.from_url(url)
    try:
        payloads = [fields[b"payload"] for _, fields in client.xrange(stream)]
    finally:
        client.delete(stream)
        client.close()
    assert payloads == [b'{"n": 1}', RAW, b'{"n": 3}']


@pytest.mark.broker("rabbitmq")
def test_rabbitmq_sends_a_bytes_payload_as_octet_stream(request: pytest.FixtureRequest) -> None:
    import pika

    sink, (url, queue, _) = build("rabbitmq", request, "raw")  # type: ignore[misc]
    assert publish(sink) == {}
    connection = pika.BlockingConnection(pika.URLParameters(url))
    got = []
    try:
        channel = connection.channel()
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            got.append((body, properties.content_type))
        channel.queue_delete(queue)
    finally:
        connection.close()
    assert got == [
        (b'{"n": 1}', "application/json"),
        (RAW, "application/octet-stream"),
        (b'{"n": 3}', "application/json"),
    ]


@pytest.mark.broker("http")
def test_http_raw_posts_a_bytes_payload_as_octet_stream() -> None:
    """The recording webhook parses JSON, so this one only records raw bodies."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    got: list[tuple[bytes, str]] = []
    lock = threading.Lock()

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                got.append((body, self.headers["Content-Type"]))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        sink = factory("http", SinkConfig(url=url, extra={"envelope": "raw"}))()
        assert publish(sink) == {}
    finally:
        server.shutdown()
        server.server_close()
    assert sorted(got) == sorted([
        (b'{"n": 1}', "application/json"),
        (RAW, "application/octet-stream"),
        (b'{"n": 3}', "application/json"),
    ])  # fmt: skip
