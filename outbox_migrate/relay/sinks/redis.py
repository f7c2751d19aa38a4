"""Redis Streams sink: one XADD per message, pipelined per batch, each reply judged on its own
(docs/sinks.md). It must not send a payload over the server's `proto-max-bulk-len`: Redis
would drop the connection and the replies of the whole pipeline with it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from outbox_migrate.errors import MessagesRejected, SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.sinks import (
    NotSent,
    SinkConfig,
    client,
    int_option,
    max_bytes,
    prepare,
    size_over,
    smaller,
    too_large,
)
from outbox_migrate.relay.sinks.envelopes import (
    CloudEvents,
    Envelope,
    envelope_option,
    require_text,
)
from outbox_migrate.relay.sinks.isolation import isolate
from outbox_migrate.relay.sinks.urls import mask_url, require_scheme

DEFAULT_URL = "redis://127.0.0.1:6379/0"
SCHEMES = ("redis", "rediss", "unix")
RETRYABLE_PREFIXES = (
    "OOM", "LOADING", "BUSY", "READONLY", "MISCONF", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN",
    "NOREPLICAS", "MOVED", "ASK",
)  # fmt: skip
"""Error replies about the server's state, not the message: back off and retry."""
BUILT_IN_FIELDS = frozenset({"id", "table", "event_type", "key", "created_at", "payload"})
LIMIT_SETTING = "proto-max-bulk-len"
DROPPED = "redis dropped the connection on this message (larger than its proto-max-bulk-len?)"


def is_permanent_reply(error: BaseException) -> bool:
    """True for an error reply about the message or its stream key, not the server's state."""
    text = str(error).lstrip()
    return not text.startswith(RETRYABLE_PREFIXES)


class RedisSink:
    name = "redis"

    def __init__(self, config: SinkConfig) -> None:
        self._redis = redis = client(self.name, "redis", "redis-py")
        url = require_scheme(self.name, config.url, SCHEMES) or DEFAULT_URL
        self.stream = config.target
        self.routed = "{event_type}" in self.stream or "{key}" in self.stream
        self.maxlen = int_option(config.extra, self.name, "maxlen", None, 0)
        self.envelope = envelope_option(config.extra, self.name, Envelope.raw)
        self.cloudevents = CloudEvents(config.extra)
        self.config = config
        self.client: Any = redis.Redis.from_url(
            url,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
        )
        self.limit = max_bytes(config, self.name)
        self._server_limit_read = False

    def _read_server_limit(self) -> None:
        """Lower `limit` to the server's proto-max-bulk-len, once, when CONFIG GET is allowed.
        Asked before any XADD: unanswered, Redis is away and nothing is written, so a frozen
        Redis costs one timeout per publish, within what the polling relay's fence allows."""
        try:
            value = self.client.config_get(LIMIT_SETTING).get(LIMIT_SETTING)
        except self._redis.ResponseError:  # NOPERM, CONFIG renamed away: keep the usual one
            value = None
        except self._redis.RedisError as exc:
            raise SinkUnavailable(self.name, mask_url(str(exc))) from None
        self._server_limit_read = True
        text = value.decode() if isinstance(value, bytes) else str(value)
        if text.isdigit():
            self.limit = smaller(self.limit, int(text))

    def _stream_of(self, message: Message) -> str:
        if not self.routed:
            return self.stream
        return self.stream.replace("{event_type}", message.event_type or "").replace(
            "{key}", message.key or ""
        )

    def _fields(self, message: Message) -> dict[str, Any]:
        """The XADD's fields, or `NotSent`: a payload no envelope can carry or one too large."""
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
            require_text(message, self.name)
            payload: str | bytes = self.cloudevents.structured(message)
        elif self.envelope is Envelope.json:
            require_text(message, self.name)
            payload = message.envelope()
        else:
            payload = message.payload  # text or bytes: redis-py sends either
        limit = self.limit
        if limit is not None and (size := size_over(payload, limit)) is not None:
            what = f"redis {LIMIT_SETTING}"
            raise NotSent(f"redis {too_large(size, limit, self.config, what)}")
        fields["payload"] = payload
        return fields

    def publish(self, batch: Sequence[Message]) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        if not self._server_limit_read:
            self._read_server_limit()
        rejected, sending = prepare(batch, self._fields)
        try:
            rejected.update(self._send(sending))
        except _Dropped:
            # Redis is up but dropped the connection on something this batch holds.
            by_id = {message.id: (message, fields) for message, fields in sending}

            def send_group(group: Sequence[Message]) -> dict[MessageId, str]:
                try:
                    return self._send([by_id[m.id] for m in group])
                except _Dropped:
                    return dict.fromkeys((m.id for m in group), DROPPED)

            suspects = [message for message, _ in sending]
            rejected.update(isolate(suspects, send_group, deadline, self.name))
        if rejected:
            raise MessagesRejected(self.name, rejected)

    def _send(self, sending: Sequence[tuple[Message, dict[str, Any]]]) -> dict[MessageId, str]:
        """XADD each message in one pipeline: the ids Redis refused, with the reply. Raises
        `_Dropped` when Redis dropped the connection yet answers a PING, else
        `SinkUnavailable` for an outage."""
        if not sending:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for message, fields in sending:
            pipe.xadd(
                self._stream_of(message), fields, maxlen=self.maxlen, approximate=True,
            )  # fmt: skip
        try:
            replies = pipe.execute(raise_on_error=False)
        except self._redis.ConnectionError as exc:
            # A timeout is never taken for a drop (a slow Redis is an outage, not a bad message).
            if not isinstance(exc, self._redis.TimeoutError) and self._answers_ping():
                raise _Dropped from None
            raise SinkUnavailable(self.name, mask_url(str(exc))) from None
        except self._redis.RedisError as exc:
            raise SinkUnavailable(self.name, mask_url(str(exc))) from None
        if len(replies) != len(sending):
            raise SinkUnavailable(self.name, "not every XADD was answered")
        rejected: dict[MessageId, str] = {}
        for (message, _), reply in zip(sending, replies, strict=True):
            if isinstance(reply, BaseException):
                if not isinstance(reply, self._redis.ResponseError) or not is_permanent_reply(
                    reply
                ):
                    raise SinkUnavailable(self.name, mask_url(str(reply)))
                rejected[message.id] = f"redis {mask_url(str(reply))}"
            elif not reply:
                raise SinkUnavailable(self.name, "an XADD returned no entry id")
        return rejected

    def _answers_ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except self._redis.RedisError:
            return False

    def close(self) -> None:
        self.client.close()


class _Dropped(Exception):
    """Redis dropped the connection during a pipeline, yet answers a PING."""
