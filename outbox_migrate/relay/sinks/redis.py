"""Redis Streams sink: one XADD per message, pipelined per batch, each reply judged on its own
(docs/sinks.md). It must not send a payload over the server's `proto-max-bulk-len`: Redis
would drop the connection and the replies of the whole pipeline with it.

The batch goes out on one of redis-py's pooled connections, its commands packed by hiredis
where installed, rather than through `client.pipeline()`: the pipeline's per-command Python
(argument flattening, the packer's type checks, the response callbacks) cost about four times
the relay's own work per message, and its client-side pipeline adds nothing a batch needs
(bench/README.md, "producers.py"). The connection, its AUTH, TLS and retries stay redis-py's."""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from outbox_migrate.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.sinks import (
    NotSent,
    SinkConfig,
    check_options,
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
from outbox_migrate.relay.sinks.urls import bad_url, mask_url, require_scheme


def _hiredis_packer() -> Callable[[tuple[Any, ...]], bytes] | None:
    """hiredis's command packer (redis-py's own speed-up, which the `redis` extra installs),
    or None: redis-py's pure-Python packer then."""
    try:
        from hiredis import pack_command
    except ImportError:  # pragma: no cover - installed with the extra
        return None
    return cast("Callable[[tuple[Any, ...]], bytes]", pack_command)  # untyped without hiredis


_hiredis_pack = _hiredis_packer()

SEND_CHUNK = 64
"""XADDs packed and written at a time: Redis runs a chunk's commands while the next one is
packed, rather than starting once the whole batch is written (sink alone, batches of 500:
+30 % at 200 B and +50 % at 2 KB against one write; chunks of 16 or 32 gain no more)."""
DEFAULT_URL = "redis://127.0.0.1:6379/0"
SCHEMES = ("redis", "rediss", "unix")
RETRYABLE_PREFIXES = (
    "OOM", "LOADING", "BUSY", "READONLY", "MISCONF", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN",
    "NOREPLICAS", "MOVED", "ASK",
)  # fmt: skip
"""Error replies about the server's state, not the message: back off and retry."""
RETRYABLE_CLASSES = frozenset({
    "OutOfMemoryError", "BusyLoadingError", "ReadOnlyError", "TryAgainError", "ClusterDownError",
    "MasterDownError", "MovedError", "AskError",
})  # fmt: skip
"""redis-py's classes for those replies (by name: the module imports redis only when used)."""
BUILT_IN_FIELDS = frozenset({"id", "table", "event_type", "key", "created_at", "payload"})
LIMIT_SETTING = "proto-max-bulk-len"
DROPPED = "redis dropped the connection on this message (larger than its proto-max-bulk-len?)"


def is_permanent_reply(error: BaseException) -> bool:
    """True for an error reply about the message or its stream key, not the server's state.
    redis-py cuts the code off the replies it has a class for (`OOM …` arrives as an
    `OutOfMemoryError` reading "command not allowed …"), so the code is read from the error's
    `status_code` where redis-py keeps it, else from its class, else from the text."""
    code = getattr(error, "status_code", None)
    text = code if isinstance(code, str) else str(error).lstrip()
    if text.startswith(RETRYABLE_PREFIXES):
        return False
    return type(error).__name__ not in RETRYABLE_CLASSES


def require_database_number(url: str) -> None:
    """redis-py reads the database from a redis:// URL's path and, when that is not a number,
    silently uses database 0: the stream would go where nobody reads it."""
    parts = urlsplit(url)
    if parts.scheme.lower() == "unix":
        return
    database = unquote(parts.path).strip("/")
    if database and not database.isdigit():
        raise RelayError(
            f"sink redis: {mask_url(url)!r}: the path names the database, a number (/0), "
            f"not {database!r}"
        )


class RedisSink:
    name = "redis"

    def __init__(self, config: SinkConfig) -> None:
        self._redis = redis = client(self.name, "redis", "redis-py")
        url = require_scheme(self.name, config.url, SCHEMES) or DEFAULT_URL
        require_database_number(url)
        check_options(self.name, config.extra, ("maxlen",))
        self.stream = config.target
        self.routed = "{event_type}" in self.stream or "{key}" in self.stream
        self.maxlen = int_option(config.extra, self.name, "maxlen", None, 0)
        self._head = self._head_of(self.stream)
        self.envelope = envelope_option(config.extra, self.name, Envelope.raw)
        self.cloudevents = CloudEvents(config.extra)
        self.config = config
        try:
            self.client: Any = redis.Redis.from_url(
                url,
                socket_timeout=config.timeout_s,
                socket_connect_timeout=config.timeout_s,
            )
        except ValueError as exc:  # redis-py's own URL parsing: a bad port, db or option
            raise bad_url(self.name, url, exc) from None
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

    def _command(self, message: Message) -> tuple[Any, ...]:
        """The message's XADD, or `NotSent`: a payload no envelope can carry or one too large.
        Fields: id, table, event_type, key, created_at, the extra headers whose names these do
        not take, payload."""
        if self.envelope is Envelope.cloudevents:
            require_text(message, self.name)
            payload: str | bytes = self.cloudevents.structured(message)
        elif self.envelope is Envelope.json:
            require_text(message, self.name)
            payload = message.envelope()
        else:
            payload = message.payload  # text or bytes: either goes as it is
        limit = self.limit
        if limit is not None and (size := size_over(payload, limit)) is not None:
            what = f"redis {LIMIT_SETTING}"
            raise NotSent(f"redis {too_large(size, limit, self.config, what)}")
        head = self._head if not self.routed else self._head_of(self._stream_of(message))
        built_in = (
            "id", message.id, "table", message.table, "event_type", message.event_type or "",
            "key", message.key or "", "created_at", message.created,
        )  # fmt: skip
        if not message.extra_headers:
            return (*head, *built_in, "payload", payload)
        extra: dict[str, str] = {}
        for name, value in message.extra_headers:
            if name not in BUILT_IN_FIELDS:
                extra.setdefault(name, value)
        return (*head, *built_in, *itertools.chain.from_iterable(extra.items()), "payload", payload)

    def _head_of(self, stream: str) -> tuple[Any, ...]:
        """`XADD <stream> [MAXLEN ~ n] *`: what every command to that stream starts with."""
        trim = () if self.maxlen is None else ("MAXLEN", "~", self.maxlen)
        return ("XADD", stream, *trim, "*")

    def publish(self, batch: Sequence[Message]) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        if not self._server_limit_read:
            self._read_server_limit()
        rejected, sending = prepare(batch, self._command)
        try:
            rejected.update(self._send(sending))
        except _Dropped:
            # Redis is up but dropped the connection on something this batch holds.
            by_id = {message.id: (message, command) for message, command in sending}

            def send_group(group: Sequence[Message]) -> dict[MessageId, str]:
                try:
                    return self._send([by_id[m.id] for m in group])
                except _Dropped:
                    return dict.fromkeys((m.id for m in group), DROPPED)

            suspects = [message for message, _ in sending]
            rejected.update(isolate(suspects, send_group, deadline, self.name))
        if rejected:
            raise MessagesRejected(self.name, rejected)

    def _send(self, sending: Sequence[tuple[Message, tuple[Any, ...]]]) -> dict[MessageId, str]:
        """XADD each message, all sent before the first reply is read: the ids Redis refused,
        with the reply. Raises `_Dropped` when Redis dropped the connection yet answers a PING,
        else `SinkUnavailable` for an outage. A dropped connection is retried as redis-py's
        own pipeline retries it (the client's `retry`), resending the whole batch: what went
        in before the drop goes in twice, which at-least-once delivery allows."""
        if not sending:
            return {}
        commands = list(map(_COMMAND, sending))
        pool = self.client.connection_pool
        try:
            conn = pool.get_connection()  # no arguments since redis-py 5.3 (the extra's floor)
        except self._redis.RedisError as exc:
            raise SinkUnavailable(self.name, mask_url(str(exc))) from None
        try:
            replies = conn.retry.call_with_retry(
                lambda: self._exchange(conn, commands), lambda _error: conn.disconnect()
            )
        except self._redis.ConnectionError as exc:
            # A timeout is never taken for a drop (a slow Redis is an outage, not a bad message).
            if not isinstance(exc, self._redis.TimeoutError) and self._answers_ping():
                raise _Dropped from None
            raise SinkUnavailable(self.name, mask_url(str(exc))) from None
        except self._redis.RedisError as exc:
            raise SinkUnavailable(self.name, mask_url(str(exc))) from None
        finally:
            pool.release(conn)
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

    def _exchange(self, conn: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send every command (`SEND_CHUNK` at a time), then read one reply per command: an
        entry id, or the `ResponseError` Redis answered that command with. Redis buffers the
        replies of what it has run while the rest is written, so the writes never wait."""
        send, step = conn.send_packed_command, SEND_CHUNK
        for start in range(0, len(commands), step):
            chunk = commands[start : start + step]
            if _hiredis_pack is not None:
                send((b"".join(map(_hiredis_pack, chunk)),))
            else:
                send(conn.pack_commands(chunk))
        replies: list[Any] = []
        response_error = self._redis.ResponseError
        read = conn.read_response
        for _ in commands:
            try:
                replies.append(read())
            except response_error as exc:
                replies.append(exc)
        return replies

    def _answers_ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except self._redis.RedisError:
            return False

    def close(self) -> None:
        self.client.close()


_COMMAND = operator.itemgetter(1)


class _Dropped(Exception):
    """Redis dropped the connection during a pipeline, yet answers a PING."""
