"""Benchmark `sink.publish` for the RabbitMQ and HTTP sinks: the old way against the new, one run.

No database: the script builds batches of messages (ids 1..N, a distinct key each, a 60-byte
JSON payload, like the relay's) and times `publish` over them, after one warm-up batch that opens
the connection. Each way runs `--rounds` times; the median round is printed, as messages per
second and as client CPU per message (`time.process_time`, this process only).

RabbitMQ (the broker at `--rabbitmq-url`, a fresh durable queue per round, deleted after):

- old: the previous sink's loop — pika BlockingConnection in confirm mode, one `basic_publish`
  per message, each waiting for its own confirm (one round trip per message);
- new: `RabbitMQSink.publish` — the whole batch written, then every confirm awaited at once;
- aiormq: the same pipelining with aiormq (`asyncio.gather` of `basic_publish`, each awaiting
  its confirm), when aiormq is installed: the library the sink did not pick, for the record.

HTTP (a webhook served from a thread of this process: asyncio, HTTP/1.1 keep-alive, answers
200 after `--latency-ms`, which stands for the network and the receiver's own work; its CPU
counts in the client CPU figure):

- old: the previous sink's loop — httpx.Client, one POST after the other;
- new: `HttpSink.publish` with 16 requests in flight (`ordering none`; every key distinct, so
  `key` ordering would be the same);
- batch: `HttpSink` with `batch=true`, one POST per batch.

Envelopes (`--only envelopes`, no broker): client CPU per message to build what the Kafka sink
hands to `produce` — (value, headers) — for `envelope=raw` (the default), `json`,
`cloudevents` (the relay's own mapping, binary mode, `ce_` headers), and the same through the
`cloudevents` SDK from PyPI (`cloudevents.core.bindings.kafka.to_binary_event` of a
`CloudEvent` per message) when it is importable, each side by side over the same messages
(two of three with a `traceparent` and a tenant as extra headers).

Usage: python bench/sinks.py [--messages 3000] [--batch 100] [--latency-ms 0,5] [--rounds 3]
[--only rabbitmq|http|envelopes]. Needs pika and httpx (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Ordering
from outbox_migrate.relay.sinks import SinkConfig

DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
PAYLOAD = '{"order": 42, "status": "created", "pad": "xxxxxxxxxxxxxxxxxxxxxxxx"}'


Built = tuple[Callable[[Sequence[Message]], None], Callable[[], None]]
"""A way to publish, built: its publish and its close."""


@dataclass
class Figure:
    sink: str
    way: str
    setting: str
    rate: float
    cpu_us: float


def batches(total: int, size: int) -> list[list[Message]]:
    now = datetime.now(UTC).isoformat()
    messages = [Message(i, "public.outbox", "OrderCreated", f"order-{i}", PAYLOAD, now)
                for i in range(1, total + 1)]  # fmt: skip
    return [messages[i : i + size] for i in range(0, total, size)]


def measure(
    publish: Callable[[Sequence[Message]], None], work: list[list[Message]]
) -> tuple[float, float]:
    """(messages/s, client CPU µs per message) for publishing every batch of `work`."""
    count = sum(len(b) for b in work)
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in work:
        publish(batch)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return count / wall, cpu / count * 1e6


Work = list[list[Message]]
Publish = Callable[[Sequence[Message]], None]


def median_round(
    rounds: int, run: Callable[[Work], tuple[float, float]], work: Work
) -> tuple[float, float]:
    results = sorted(run(work) for _ in range(rounds))
    middle = results[len(results) // 2]
    return middle[0], statistics.median(r[1] for r in results)


def finish(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on a loop (connection handlers, writer tasks) and close it."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.close()


# -- RabbitMQ ----------------------------------------------------------------------------------


def old_rabbitmq(url: str, queue: str) -> Built:
    """The previous sink's loop: BlockingConnection, confirm mode, a confirm per message."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.confirm_delivery()
    channel.queue_declare(queue=queue, durable=True)

    def publish(batch: Sequence[Message]) -> None:
        for message in batch:
            properties = pika.BasicProperties(
                message_id=str(message.id), type=message.event_type,
                content_type="application/json", delivery_mode=2, headers=message.headers(),
            )  # fmt: skip
            channel.basic_publish(exchange="", routing_key=queue, body=message.payload_bytes,
                                  properties=properties, mandatory=True)  # fmt: skip

    return publish, connection.close


def new_rabbitmq(url: str, queue: str) -> Built:
    from outbox_migrate.relay.sinks.rabbitmq import RabbitMQSink

    sink = RabbitMQSink(SinkConfig(url=url, target=queue))
    return sink.publish, sink.close


def aiormq_rabbitmq(url: str, queue: str) -> Built:
    """Pipelined confirms with aiormq: a gather of publishes, each awaiting its confirm."""
    import aiormq
    from pamqp.commands import Basic

    loop = asyncio.new_event_loop()
    connection = loop.run_until_complete(aiormq.connect(url))
    channel = loop.run_until_complete(connection.channel())
    loop.run_until_complete(channel.queue_declare(queue, durable=True))

    publish = cast(Any, channel).basic_publish  # `wait` is the Channel's, not its base's

    async def publish_all(batch: Sequence[Message]) -> None:
        await asyncio.gather(*(
            publish(
                message.payload_bytes, routing_key=queue, mandatory=True, wait=False,
                properties=Basic.Properties(
                    message_id=str(message.id), message_type=message.event_type,
                    content_type="application/json", delivery_mode=2,
                    headers=cast(dict[str, Any], message.headers()),
                ),
            )
            for message in batch
        ))  # fmt: skip

    def close() -> None:
        loop.run_until_complete(connection.close())
        finish(loop)

    return lambda batch: loop.run_until_complete(publish_all(batch)), close


def bench_rabbitmq(url: str, work: list[list[Message]], rounds: int) -> list[Figure]:
    import pika

    ways = {"old": old_rabbitmq, "new": new_rabbitmq}
    try:
        import aiormq  # noqa: F401
    except ImportError:
        print("(aiormq not installed: its column is skipped)")
    else:
        ways["aiormq"] = aiormq_rabbitmq
    figures = []
    for way, build in ways.items():

        def run(
            work: list[list[Message]], build: Callable[[str, str], Built] = build
        ) -> tuple[float, float]:
            queue = f"om-bench-{uuid.uuid4().hex[:8]}"
            publish, close = build(url, queue)
            try:
                publish(work[0])  # warm-up: connection, channel, queue
                return measure(publish, work)
            finally:
                close()
                admin = pika.BlockingConnection(pika.URLParameters(url))
                admin.channel().queue_delete(queue)
                admin.close()

        rate, cpu = median_round(rounds, run, work)
        figures.append(Figure("rabbitmq", way, "", rate, cpu))
    return figures


# -- HTTP --------------------------------------------------------------------------------------


class Webhook:
    """An asyncio HTTP/1.1 server on its own thread: reads a request, answers 200 after a delay."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.started.wait(10)
        self.url = f"http://127.0.0.1:{self.port}/hook"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()  # the client left, or the bench is over

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=256)
        )
        self.port = server.sockets[0].getsockname()[1]
        self.started.set()
        self.loop.run_forever()
        server.close()
        finish(self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def old_http(url: str) -> Built:
    """The previous sink's loop: httpx.Client, one POST after the other."""
    import httpx

    client = httpx.Client(timeout=10.0)

    def publish(batch: Sequence[Message]) -> None:
        for message in batch:
            headers = {
                "Content-Type": "application/json",
                "Idempotency-Key": str(message.id),
                "X-Outbox-Id": str(message.id),
                "X-Event-Type": message.event_type or "",
            }
            response = client.post(url, content=message.envelope(), headers=headers)
            assert response.status_code < 300

    return publish, client.close


def new_http(url: str, **extra: str) -> Built:
    from outbox_migrate.relay.sinks.http import HttpSink

    sink = HttpSink(SinkConfig(url=url, extra=extra, ordering=Ordering.none))
    return sink.publish, sink.close


def bench_http(latency_ms: float, work: list[list[Message]], rounds: int) -> list[Figure]:
    webhook = Webhook(latency_ms / 1000)
    ways: dict[str, Callable[[str], Built]] = {
        "old": old_http,
        "new": new_http,
        "batch": lambda url: new_http(url, batch="true"),
    }
    figures = []
    try:
        for way, build in ways.items():

            def run(
                work: list[list[Message]], build: Callable[[str], Built] = build
            ) -> tuple[float, float]:
                publish, close = build(webhook.url)
                try:
                    publish(work[0])
                    return measure(publish, work)
                finally:
                    close()

            rate, cpu = median_round(rounds, run, work)
            figures.append(Figure("http", way, f"{latency_ms:g} ms", rate, cpu))
    finally:
        webhook.stop()
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-ms", default="0,5", help="webhook answer delays, comma list")
    parser.add_argument("--rabbitmq-url", default=DEFAULT_RABBITMQ_URL)
    parser.add_argument("--only", choices=["rabbitmq", "http", "envelopes"])
    args = parser.parse_args(argv)
    work = batches(args.messages, args.batch)
    if args.only == "envelopes":
        bench_envelopes(work, args.rounds)
        return
    figures: list[Figure] = []
    if args.only in (None, "rabbitmq"):
        figures += bench_rabbitmq(args.rabbitmq_url, work, args.rounds)
    if args.only in (None, "http"):
        for latency in args.latency_ms.split(","):
            figures += bench_http(float(latency), work, args.rounds)
    print(f"{args.messages} messages in batches of {args.batch}, median of {args.rounds} rounds")
    print(f"{'sink':<9} {'webhook':>8} {'way':<7} {'msgs/s':>8} {'vs old':>6} {'CPU µs/msg':>11}")
    old = {(f.sink, f.setting): f.rate for f in figures if f.way == "old"}
    for f in figures:
        print(f"{f.sink:<9} {f.setting:>8} {f.way:<7} {f.rate:>8,.0f} "
              f"{f.rate / old[(f.sink, f.setting)]:>6.1f} {f.cpu_us:>11.0f}")  # fmt: skip


TRACE = (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
         ("tenant-id", "acme"))  # fmt: skip


def bench_envelopes(work: Work, rounds: int) -> None:
    """CPU per message of (value, headers) as the Kafka sink builds them, per envelope."""
    from outbox_migrate.relay.sinks.envelopes import CloudEvents

    messages = [m._replace(extra_headers=TRACE if m.id % 3 else ()) for b in work for m in b]
    ce = CloudEvents({})

    def raw(m: Message) -> object:
        return m.payload_bytes, list(m.headers().items())

    def json_envelope(m: Message) -> object:
        return m.envelope().encode(), list(m.headers().items())

    def cloudevents_own(m: Message) -> object:
        headers = ce.binary_headers(m, "ce_", content_type=False)
        headers["content-type"] = "application/json"
        return m.payload_bytes, list(headers.items())

    ways: list[tuple[str, Callable[[Message], object]]] = [
        ("raw", raw), ("json", json_envelope), ("cloudevents (own)", cloudevents_own),
    ]  # fmt: skip
    try:
        from cloudevents.core.bindings.kafka import to_binary_event
        from cloudevents.core.v1.event import CloudEvent
    except ImportError:
        print("cloudevents SDK not importable: its row is left out")
    else:

        def cloudevents_sdk(m: Message) -> object:
            attributes = ce.attributes(m)
            event = CloudEvent(attributes={**attributes, "time": m.created_at},
                               data=m.payload_bytes)  # fmt: skip
            kafka = to_binary_event(event)
            headers = {**kafka.headers, **m.headers()}
            return kafka.value, list(headers.items())

        ways.append(("cloudevents (SDK)", cloudevents_sdk))
    results: dict[str, float] = {}
    for name, build in ways:
        per_round = []
        for _ in range(rounds):
            started = time.process_time()
            for m in messages:
                build(m)
            per_round.append((time.process_time() - started) / len(messages) * 1e6)
        results[name] = statistics.median(per_round)
    print(f"{len(messages)} messages, Kafka (value, headers) built per envelope, "
          f"median of {rounds} rounds")  # fmt: skip
    print(f"{'envelope':<20} {'CPU µs/msg':>11} {'vs raw':>7}")
    for name, us in results.items():
        print(f"{name:<20} {us:>11.2f} {us / results['raw']:>7.1f}")


if __name__ == "__main__":
    main()
