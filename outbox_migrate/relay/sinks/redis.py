"""Redis Streams sink: one XADD per message, pipelined per batch.

Acknowledged = Redis replied with the entry id for the message's XADD. Redis answers from
memory; whether the entry survives a Redis crash depends on its own persistence (`appendonly
yes` + `appendfsync always` for the strictest). Fields: id, table, event_type, key,
created_at, then the row's extra headers (e.g. `traceparent`; a name already taken is
skipped), then `payload`: the payload as stored (`envelope=raw`, the default), the relay's
JSON envelope (`json`) or a CloudEvents 1.0 structured-mode JSON object (`cloudevents`).

The stream key is `SinkConfig.target`; it may name `{event_type}` or `{key}`, filled per
message (`orders.{event_type}`), so one outbox can feed several streams. `extra["maxlen"]`
caps each stream (approximate trimming).

Every reply is looked at on its own (`raise_on_error=False`): an error that belongs to the
message or its stream key — WRONGTYPE (the key holds a list, a string…), NOPERM (the ACL
user may not write that key), any other `ERR` about the command (an invalid argument, an
entry id Redis refuses) — is `MessagesRejected` under its id, and the other messages of the
batch are acknowledged. A lost connection, a timeout, or a refusal about the server's state
(OOM under `maxmemory`, LOADING, BUSY, READONLY replica, MISCONF, TRYAGAIN, CLUSTERDOWN,
MASTERDOWN) is `SinkUnavailable`: nothing of the batch is marked and the relay backs off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox_migrate.relay.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.sinks import SinkConfig
from outbox_migrate.relay.sinks.envelopes import CloudEvents, Envelope, envelope_option
from outbox_migrate.relay.sinks.urls import mask_url, require_scheme

DEFAULT_URL = "redis://127.0.0.1:6379/0"
SCHEMES = ("redis", "rediss", "unix")
RETRYABLE_PREFIXES = (
    "OOM", "LOADING", "BUSY", "READONLY", "MISCONF", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN",
    "NOREPLICAS", "MOVED", "ASK",
)  # fmt: skip
"""Error replies about the server's state, not the message: back off and retry."""
BUILT_IN_FIELDS = frozenset({"id", "table", "event_type", "key", "created_at", "payload"})


def is_permanent_reply(error: BaseException) -> bool:
    """True for an error reply that refuses this message (see the module docstring)."""
    text = str(error).lstrip()
    return not text.startswith(RETRYABLE_PREFIXES)


class RedisSink:
    name = "redis"

    def __init__(self, config: SinkConfig) -> None:
        try:
            import redis
        except ImportError:
            raise RelayError(
                "the redis sink needs redis-py: install outbox-migrate[redis]"
            ) from None
        self._redis = redis
        url = require_scheme(self.name, config.url, SCHEMES) or DEFAULT_URL
        self.stream = config.target
        self.routed = "{event_type}" in self.stream or "{key}" in self.stream
        maxlen = config.extra.get("maxlen")
        if maxlen is not None and not maxlen.isdigit():
            raise RelayError(f"sink redis: maxlen={maxlen!r} is not a whole number")
        self.maxlen = int(maxlen) if maxlen is not None else None
        self.envelope = envelope_option(config.extra, self.name, Envelope.raw)
        self.cloudevents = CloudEvents(config.extra)
        self.client: Any = redis.Redis.from_url(
            url,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
        )

    def _stream_of(self, message: Message) -> str:
        if not self.routed:
            return self.stream
        return self.stream.replace("{event_type}", message.event_type or "").replace(
            "{key}", message.key or ""
        )

    def _fields(self, message: Message) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "id": message.id,
            "table": message.table,
            "event_type": message.event_type or "",
            "key": message.key or "",
            "created_at": message.created,
        }
        for name, value in message.extra_headers:
            if name not in BUILT_IN_FIELDS:
                fields.setdefault(name, value)
        if self.envelope is Envelope.cloudevents:
            fields["payload"] = self.cloudevents.structured(message)
        elif self.envelope is Envelope.json:
            fields["payload"] = message.envelope()
        else:
            fields["payload"] = message.payload
        return fields

    def publish(self, batch: Sequence[Message]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for message in batch:
            pipe.xadd(
                self._stream_of(message), self._fields(message),
                maxlen=self.maxlen, approximate=True,
            )  # fmt: skip
        try:
            replies = pipe.execute(raise_on_error=False)
        except self._redis.RedisError as exc:
            raise SinkUnavailable(self.name, mask_url(str(exc))) from None
        if len(replies) != len(batch):
            raise SinkUnavailable(self.name, "not every XADD was answered")
        rejected: dict[MessageId, str] = {}
        for message, reply in zip(batch, replies, strict=True):
            if isinstance(reply, BaseException):
                if not isinstance(reply, self._redis.ResponseError) or not is_permanent_reply(
                    reply
                ):
                    raise SinkUnavailable(self.name, mask_url(str(reply)))
                rejected[message.id] = f"redis {mask_url(str(reply))}"
            elif not reply:
                raise SinkUnavailable(self.name, "an XADD returned no entry id")
        if rejected:
            raise MessagesRejected(self.name, rejected)

    def close(self) -> None:
        self.client.close()
