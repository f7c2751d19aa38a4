"""Sinks: where the relay publishes. One small protocol (`Sink`), one module per broker.

A sink must not report a message acknowledged before its broker did, nor send a body it knows
the broker refuses (docs/sinks.md); broker clients are imported only when a sink is built.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from outbox_migrate.errors import RelayError
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.options import Ordering

_D = TypeVar("_D", int, None)
_T = TypeVar("_T")
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
    None = the broker's usual limit, where the sink knows one (`max_bytes`)."""


BUILTIN: dict[str, str] = {
    "stdout": "outbox_migrate.relay.sinks.stdout:StdoutSink",
    "kafka": "outbox_migrate.relay.sinks.kafka:KafkaSink",
    "rabbitmq": "outbox_migrate.relay.sinks.rabbitmq:RabbitMQSink",
    "nats": "outbox_migrate.relay.sinks.nats:NatsSink",
    "redis": "outbox_migrate.relay.sinks.redis:RedisSink",
    "http": "outbox_migrate.relay.sinks.http:HttpSink",
}


def factory(name: str, config: SinkConfig | None = None) -> SinkFactory:
    """A factory for sink `name`: a built-in, or `package.module:Callable` for your own, which
    is called with the `SinkConfig` once per worker."""
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
    return functools.partial(build, config)


def client(sink: str, module: str, package: str) -> Any:
    """Import a sink's broker client: a missing one is a configuration error naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise RelayError(
            f"the {sink} sink needs {package}: install outbox-migrate[{sink}]"
        ) from None


def require_internals(sink: str, package: str, owner: type, names: Sequence[str]) -> None:
    """Refuse at start, with one line, a client library whose `owner` class lacks the methods
    (not its public API) a sink writes through: every publish would otherwise fail as an
    outage, retried for ever. The sink's unit tests pin what those methods must do."""
    missing = [name for name in names if not callable(getattr(owner, name, None))]
    if missing:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = f"{package} {version(package)}"
        except PackageNotFoundError:
            installed = package
        listed = ", ".join(f"{owner.__name__}.{name}" for name in missing)
        raise RelayError(
            f"sink {sink}: {installed} has no {listed}, which the sink writes through; install "
            f"the {package} release pyproject.toml names for outbox-migrate[{sink}]"
        )


def event_loop(sink: str) -> asyncio.AbstractEventLoop:
    """A private event loop for a sink's asyncio client. An exception escaping one of the
    library's callbacks (pika's connect workflow meeting a socket reset under it) is logged
    on the sink's library logger, one line through `relay.sink_library`, rather than by
    asyncio's default handler as an ERROR with a traceback: the sink reports the failure
    itself, as an outage, when its publish notices it."""
    loop = asyncio.new_event_loop()
    log = logging.getLogger(f"outbox_migrate.relay.sink.{sink}")

    def handle(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        log.warning(
            "%s", context.get("message") or "error in a callback", exc_info=context.get("exception")
        )

    loop.set_exception_handler(handle)
    return loop


ENVELOPE_OPTIONS = ("envelope", "ce_source", "ce_type")
"""The options every built-in sink takes: its body's envelope and the CloudEvents attributes."""


def check_options(
    sink: str, extra: Mapping[str, str], own: Sequence[str], *, dotted: str | None = None
) -> None:
    """Refuse an option the sink does not read: a misspelt one (`maxlenn=10`) would otherwise
    be ignored in silence while the operator believes it applies. `dotted`: what names with a
    dot are passed to (Kafka: librdkafka, which checks them itself)."""
    known = (*own, *ENVELOPE_OPTIONS)
    unknown = sorted(k for k in extra if k not in known and not (dotted and "." in k))
    if unknown:
        also = f", or a {dotted} setting (a name with a dot)" if dotted else ""
        raise RelayError(
            f"sink {sink}: unknown --sink-option {', '.join(map(repr, unknown))}: it takes "
            f"{', '.join(sorted(known))}{also}"
        )


def int_option(
    extra: Mapping[str, str], sink: str, name: str, default: _D, minimum: int
) -> int | _D:
    """A whole-number sink option; anything else is a configuration error."""
    raw = extra.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise RelayError(f"{sink} sink: {name} must be an integer >= {minimum}, got {raw!r}")
    return value


class NotSent(Exception):
    """A message refused before it is sent (it could never be delivered): the reason."""


def prepare(
    batch: Sequence[Message], build: Callable[[Message], _T]
) -> tuple[dict[MessageId, str], list[tuple[Message, _T]]]:
    """Each message's wire form, built once, and the ids `build` refused (`NotSent`)."""
    refused: dict[MessageId, str] = {}
    ready: list[tuple[Message, _T]] = []
    for message in batch:
        try:
            ready.append((message, build(message)))
        except NotSent as exc:
            refused[message.id] = str(exc)
    return refused, ready


MIB = 1024 * 1024
USUAL_LIMIT_BYTES: dict[str, int] = {
    "rabbitmq": 128 * MIB,
    "redis": 512 * MIB,
}
"""The broker's default, where the sink itself checks it when `--max-message-bytes` is not
given; Kafka's and NATS's clients check their own (docs/sinks.md, "Refused or too large")."""


def max_bytes(config: SinkConfig, sink: str) -> int | None:
    """The limit a sink checks bodies against: `--max-message-bytes`, else the usual one."""
    if config.max_message_bytes is not None:
        return config.max_message_bytes
    return USUAL_LIMIT_BYTES.get(sink)


def smaller(limit: int | None, learned: int | None) -> int | None:
    """The stricter of two limits (None = no limit)."""
    if limit is None:
        return learned
    return limit if learned is None else min(limit, learned)


def size_over(body: str | bytes, limit: int) -> int | None:
    """The size of `body` (UTF-8 for text) when it is over `limit`, else None. Per message: a
    character is at most 4 bytes, so most texts are judged without encoding them."""
    if isinstance(body, bytes):
        return len(body) if len(body) > limit else None
    if len(body) * 4 <= limit:
        return None
    size = len(body.encode())
    return size if size > limit else None


def too_large(size: int, limit: int, config: SinkConfig, what: str) -> str:
    """The rejection reason: the sizes and where the limit came from."""
    source = (
        "--max-message-bytes"
        if config.max_message_bytes is not None and limit == config.max_message_bytes
        else what
    )
    return f"message too large: {size} bytes over the limit of {limit} ({source}); not sent"
