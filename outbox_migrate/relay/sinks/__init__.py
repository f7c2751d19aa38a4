"""Sinks: where the relay publishes. One small protocol; one module per broker.

A sink's `publish(batch)` returns only once the broker acknowledged every message of the batch
(that is what lets the relay mark them published), raises `SinkUnavailable` when nothing can be
trusted as delivered, or `MessagesRejected` naming the ids it refused. Each relay worker gets its
own sink instance from a factory, so sinks need not be thread-safe. A sink that sends a batch's
messages concurrently (http) keeps the order `SinkConfig.ordering` asks for. Broker clients are
imported only when their sink is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from outbox_migrate.errors import RelayError
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Ordering

DEFAULT_TARGET = "outbox"
DEFAULT_TIMEOUT_S = 10.0


class Sink(Protocol):
    """Publish a batch and wait for the broker's acknowledgement."""

    name: str

    def publish(self, batch: Sequence[Message]) -> None: ...

    def close(self) -> None: ...


SinkFactory = Callable[[], Sink]


@dataclass(frozen=True)
class SinkConfig:
    """Where and how to publish; the meaning of `target` depends on the broker."""

    url: str | None = None
    target: str = DEFAULT_TARGET
    """Kafka topic, RabbitMQ routing key (default exchange: the queue), NATS subject prefix,
    Redis stream key; unused by stdout and HTTP."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    extra: Mapping[str, str] = field(default_factory=dict)
    ordering: Ordering | None = None
    """The relay's `--ordering`, for sinks that publish a batch concurrently (http). None = not
    told (a library caller that built the config itself): such sinks then keep strict id order,
    the strongest promise, rather than guess."""
    max_message_bytes: int | None = None
    """The relay's `--max-message-bytes`: a body larger than this is rejected before it is sent.
    None = the broker's usual limit, where the sink knows one (sinks/limits.py)."""


BUILTIN: dict[str, str] = {
    "stdout": "outbox_migrate.relay.sinks.stdout:StdoutSink",
    "kafka": "outbox_migrate.relay.sinks.kafka:KafkaSink",
    "rabbitmq": "outbox_migrate.relay.sinks.rabbitmq:RabbitMQSink",
    "nats": "outbox_migrate.relay.sinks.nats:NatsSink",
    "redis": "outbox_migrate.relay.sinks.redis:RedisSink",
    "http": "outbox_migrate.relay.sinks.http:HttpSink",
}


def factory(name: str, config: SinkConfig | None = None) -> SinkFactory:
    """A factory for sink `name` (a built-in, or `package.module:Callable` for your own).

    The callable is called with the `SinkConfig` once per worker.
    """
    config = config or SinkConfig()
    path = BUILTIN.get(name, name)
    module_name, _, attribute = path.partition(":")
    if not attribute:
        raise RelayError(
            f"unknown sink {name!r}: choose one of {', '.join(BUILTIN)} or give module:callable"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f" (install outbox-migrate[{name}])" if name in BUILTIN else ""
        raise RelayError(f"sink {name!r} cannot be loaded: {exc}{hint}") from None
    build = getattr(module, attribute, None)
    if build is None:
        raise RelayError(f"sink {name!r}: {module_name} has no {attribute}")

    def make() -> Sink:
        sink: Sink = build(config)
        return sink

    return make
