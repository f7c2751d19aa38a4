"""RabbitMQ sink (pika, AMQP 0-9-1): a whole batch published, then every confirm awaited at once.

A nack is back-pressure, never a reason to dead-letter; the outcomes are in docs/sinks.md,
"RabbitMQ".
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from outbox_migrate.dsn import mask
from outbox_migrate.errors import MessagesRejected, SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.sinks import (
    NotSent,
    SinkConfig,
    check_options,
    client,
    event_loop,
    max_bytes,
    prepare,
    require_internals,
    size_over,
    smaller,
    too_large,
)
from outbox_migrate.relay.sinks.envelopes import (
    CloudEvents,
    Envelope,
    body_bytes,
    content_type,
    envelope_option,
)
from outbox_migrate.relay.sinks.urls import bad_url, require_scheme

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
PUBLISH_CHUNK = 64
"""Messages built and handed to the loop's writer at a time, so the broker stores and confirms
one chunk while the next is built rather than starting once the whole batch is written."""
CLOSE_TIMEOUT_S = 2.0
"""How long closing a connection may wait for the broker's Close-Ok before it is dropped."""
PRECONDITION_FAILED = 406
SHORT_STRING_BYTES = 255
"""AMQP 0-9-1 `shortstr`: the message_id and type properties and header table names."""
CLOUDEVENTS_PREFIX = "cloudEvents:"
TOO_LARGE = re.compile(r"larger than configured max size (\d+)")
"""RabbitMQ's channel-close text for a body over `max_message_size` (3.8 and later)."""


class Confirms:
    """Publisher-confirm bookkeeping for one confirm-mode channel (tags 1, 2, … after
    Confirm.Select; `multiple` settles every tag up to one). Pure data; no I/O."""

    def __init__(self) -> None:
        self.last_tag = 0
        self.pending: dict[int, MessageId] = {}
        """Delivery tag → outbox id, for messages not confirmed yet."""
        self.nacked: list[MessageId] = []
        self.acked: list[MessageId] = []
        """Outbox ids acked in this batch (what need not be sent again after a channel close)."""
        self.returned: dict[MessageId, str] = {}
        """Outbox id → reason, for messages the broker returned as unroutable."""
        self._lowest = 1
        """No tag below this one is pending (keeps `multiple` confirms O(1) amortised)."""

    def start_batch(self) -> None:
        self.nacked.clear()
        self.acked.clear()
        self.returned.clear()

    def sent(self, outbox_id: MessageId) -> None:
        self.last_tag += 1
        self.pending[self.last_tag] = outbox_id

    def confirmed(self, tag: int, *, multiple: bool, ack: bool) -> None:
        if multiple:
            settled = [self.pending.pop(t) for t in range(self._lowest, tag + 1)
                       if t in self.pending]  # fmt: skip
            self._lowest = max(self._lowest, tag + 1)
        else:
            outbox_id = self.pending.pop(tag, None)
            settled = [] if outbox_id is None else [outbox_id]
        (self.acked if ack else self.nacked).extend(settled)

    @property
    def settled(self) -> bool:
        return not self.pending


class _Closed(Exception):
    """The connection or channel closed while the sink waited on it."""

    def __init__(self, reason: str, max_size: int | None = None) -> None:
        super().__init__(reason)
        self.max_size = max_size
        """Set when the broker closed the channel for a body over this many bytes."""


def check_short_strings(message: Message) -> None:
    """`NotSent` when the event type, the outbox id or a header name is over an AMQP short
    string's 255 bytes (pika cannot encode it). Per message: short texts are judged by length."""
    fields = [("event type", message.event_type), ("outbox id", str(message.id))]
    fields += [("header name", name) for name, _ in message.extra_headers]
    for what, text in fields:
        if text is None or len(text) * 4 <= SHORT_STRING_BYTES:
            continue
        size = size_over(text, SHORT_STRING_BYTES)
        if size is not None:
            raise NotSent(
                f"rabbitmq {what} of {size} bytes: AMQP carries at most {SHORT_STRING_BYTES} "
                f"(a short string); not sent: {text[:40]!r}…"
            )


def too_large_limit(reply_code: object, reply_text: object) -> int | None:
    """The broker's `max_message_size` when a channel close says a body exceeded it."""
    if reply_code != PRECONDITION_FAILED or not isinstance(reply_text, str):
        return None
    found = TOO_LARGE.search(reply_text)
    return int(found.group(1)) if found else None


class RabbitMQSink:
    name = "rabbitmq"

    def __init__(self, config: SinkConfig) -> None:
        self._pika = client(self.name, "pika", "pika")
        adapter = client(self.name, "pika.adapters.asyncio_connection", "pika")
        self._connection_class = adapter.AsyncioConnection
        require_internals(self.name, "pika", adapter.AsyncioConnection, ("_adapter_emit_data",))
        self.config = config
        check_options(self.name, config.extra, ("exchange",))
        self.exchange = config.extra.get("exchange", "")
        self.routing_key = config.target
        self.url = require_scheme(self.name, config.url, ("amqp", "amqps")) or DEFAULT_URL
        self.envelope = envelope_option(config.extra, self.name, Envelope.raw)
        self.cloudevents = CloudEvents(config.extra)
        try:
            self._params = params = self._pika.URLParameters(self.url)
        except Exception as exc:  # noqa: BLE001 - pika raises ValueError, KeyError, …
            raise bad_url(self.name, self.url, exc) from None
        params.socket_timeout = config.timeout_s
        params.stack_timeout = config.timeout_s
        params.blocked_connection_timeout = config.timeout_s
        params.connection_attempts = 1
        if "heartbeat=" not in self.url:
            # The loop runs only inside `publish`: neither side could honour heartbeats while
            # the relay idles; the next publish finds a dead connection instead.
            params.heartbeat = 0
        self._loop = event_loop(self.name)
        self._connection: Any = None
        self._channel: Any = None
        self._closed: asyncio.Future[None] | None = None
        self._confirms = Confirms()
        self._waiter: asyncio.Future[Any] | None = None
        """What the sink awaits now; a close callback fails it (callbacks cannot raise)."""
        self._all_sent = True
        """False while a batch is being written: its confirms so far do not settle it."""
        self._max_size: int | None = None
        """The broker's max_message_size, once a channel close told it."""
        self.limit = max_bytes(config, self.name)

    # -- callbacks (run by the event loop) ------------------------------------------------

    def _fail_waiter(self, reason: str, max_size: int | None = None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(_Closed(reason, max_size))

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        if channel is self._channel:
            self._channel = None
            limit = too_large_limit(
                getattr(reason, "reply_code", None), getattr(reason, "reply_text", None)
            )
            self._fail_waiter(f"channel closed: {reason!r}", limit)

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        ack = isinstance(method, self._pika.spec.Basic.Ack)
        self._confirms.confirmed(method.delivery_tag, multiple=method.multiple, ack=ack)
        waiter = self._waiter
        if self._all_sent and self._confirms.settled and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_return(self, _channel: Any, method: Any, properties: Any, _body: bytes) -> None:
        try:
            outbox_id = int(properties.message_id)
        except (TypeError, ValueError):  # not one of ours; nothing to report
            return
        self._confirms.returned[outbox_id] = f"unroutable: {method.reply_code} {method.reply_text}"

    # -- connection ------------------------------------------------------------------------

    async def _wait(self, start: Callable[[Callable[..., None]], object]) -> Any:
        """Call `start(callback)` and wait until pika calls the callback (or the link closes)."""
        waiter: asyncio.Future[Any] = self._loop.create_future()
        self._waiter = waiter

        def callback(*args: Any) -> None:
            if not waiter.done():
                waiter.set_result(args[0] if args else None)

        try:
            start(callback)
            return await waiter
        finally:
            self._waiter = None

    async def _open(self) -> Any:
        if self._channel is not None and self._channel.is_open:
            return self._channel
        self._disconnect_now()
        closed: asyncio.Future[None] = self._loop.create_future()
        self._closed = closed

        def on_closed(connection: Any, reason: BaseException) -> None:
            # Also called for a connection this sink already replaced: only the current one
            # may fail what the sink waits for.
            if not closed.done():
                closed.set_result(None)
            if connection is self._connection:
                self._channel = None
                self._fail_waiter(f"connection closed: {reason!r}")

        def connect(callback: Callable[..., None]) -> None:
            self._connection = self._connection_class(
                self._params,
                on_open_callback=callback,
                on_open_error_callback=on_closed,
                on_close_callback=on_closed,
                custom_ioloop=self._loop,
            )

        await self._wait(connect)
        channel = await self._wait(lambda cb: self._connection.channel(on_open_callback=cb))
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        self._confirms = Confirms()
        await self._wait(lambda cb: channel.confirm_delivery(self._on_confirm, callback=cb))
        if not self.exchange:
            await self._wait(
                lambda cb: channel.queue_declare(self.routing_key, durable=True, callback=cb)
            )
        return channel

    # -- publishing ------------------------------------------------------------------------

    async def _publish(self, batch: Sequence[tuple[Message, bytes]]) -> None:
        async with asyncio.timeout(self.config.timeout_s):
            channel = await self._open()
        confirms = self._confirms
        confirms.start_batch()
        properties = self._pika.BasicProperties
        exchange, routing_key = self.exchange, self.routing_key

        waiter: asyncio.Future[Any] = self._loop.create_future()
        self._waiter, self._all_sent = waiter, False
        try:
            async with asyncio.timeout(self.config.timeout_s):
                for start in range(0, len(batch), PUBLISH_CHUNK):
                    with self._one_write():
                        for message, body in batch[start : start + PUBLISH_CHUNK]:
                            channel.basic_publish(
                                exchange,
                                routing_key,
                                body,
                                properties(
                                    message_id=str(message.id),
                                    type=message.event_type,
                                    content_type=content_type(message),
                                    delivery_mode=2,
                                    headers=self._headers(message),
                                ),
                                mandatory=True,
                            )
                            confirms.sent(message.id)
                    if waiter.done():  # the channel or connection closed meanwhile
                        break
                    # The loop writes this chunk while the next one is built.
                    await asyncio.sleep(0)
                self._all_sent = True
                if confirms.settled and not waiter.done():  # an empty or confirmed batch
                    waiter.set_result(None)
                # One wait for the whole batch: `_on_confirm` resolves it at the last tag.
                await waiter
        finally:
            self._waiter, self._all_sent = None, True

    @contextlib.contextmanager
    def _one_write(self) -> Iterator[None]:
        """The frames published inside, handed to the socket as one write. pika queues every
        frame (three per message) as a write of its own, and its writer sends each with a
        `send` call: a system call and a TCP segment per frame, for the relay and for the
        broker reading them. The frames are collected in order and written together, also
        when a publish raises half-way (what the channel counted as sent is then on the wire)."""
        connection = self._connection
        emit = connection._adapter_emit_data
        frames: list[bytes] = []
        connection._adapter_emit_data = frames.append
        try:
            yield
        finally:
            del connection._adapter_emit_data  # the class's own again
            if frames:
                emit(b"".join(frames))

    def _headers(self, message: Message) -> Any:
        if self.envelope is Envelope.cloudevents:
            return self.cloudevents.binary_headers(message, CLOUDEVENTS_PREFIX, content_type=False)
        return message.headers()

    def _oversized(self, batch: Sequence[tuple[Message, bytes]]) -> dict[MessageId, str]:
        """Messages whose body the broker refuses for good: over `--max-message-bytes` (else
        128 MiB) or the `max_message_size` a channel close named."""
        limit = smaller(self.limit, self._max_size)
        if limit is None:
            return {}
        told = limit == self._max_size
        return {
            m.id: (
                f"message too large: {size} bytes over the broker's max_message_size {limit}"
                if told
                else too_large(size, limit, self.config, "rabbitmq's default max_message_size")
            )
            for m, body in batch
            if (size := len(body)) > limit
        }

    def _body(self, message: Message) -> bytes:
        """The message's body, or `NotSent` when AMQP cannot carry it."""
        check_short_strings(message)
        return body_bytes(message, self.envelope, self.name)

    def publish(self, batch: Sequence[Message]) -> None:
        refused, bodies = prepare(batch, self._body)
        refused.update(self._oversized(bodies))
        sending = [mb for mb in bodies if mb[0].id not in refused] if refused else bodies
        try:
            try:
                self._send(sending)
            except _Closed as exc:
                if exc.max_size is None:
                    raise
                # A body over the broker's limit closed the channel: those messages are
                # poisonous, the others are sent again on a fresh channel.
                self._max_size = exc.max_size
                too_large = self._oversized(sending)
                if not too_large:
                    raise
                # Acked before the close (returned ones included: RabbitMQ acks them after the
                # return): not sent again. Unconfirmed ones are — at least once, as after any
                # retry; consumers de-duplicate on message_id.
                done = set(self._confirms.acked)
                refused.update(too_large)
                refused.update(self._confirms.returned)
                sending = [
                    (m, body) for m, body in sending if m.id not in too_large and m.id not in done
                ]
                self._send(sending)
        except Exception as exc:  # noqa: BLE001 - pika, asyncio and OS errors all mean "not acked"
            self._disconnect()
            if isinstance(exc, TimeoutError):
                reason = f"no confirm within {self.config.timeout_s:g} s"
            elif isinstance(exc, _Closed):
                reason = str(exc)
            else:
                reason = f"{type(exc).__name__}: {exc}"
            password = self._params.credentials.password
            raise SinkUnavailable(self.name, mask(reason, password)) from None
        confirms = self._confirms
        if confirms.nacked:
            raise SinkUnavailable(
                self.name,
                f"broker nacked {len(confirms.nacked)} message(s), e.g. id {confirms.nacked[0]}",
            )
        if confirms.returned or refused:
            raise MessagesRejected(self.name, {**confirms.returned, **refused})

    def _send(self, batch: Sequence[tuple[Message, bytes]]) -> None:
        if batch:
            self._loop.run_until_complete(self._publish(batch))
        else:
            self._confirms.start_batch()  # nothing left to send: no stale outcomes either

    # -- closing ---------------------------------------------------------------------------

    def _disconnect_now(self) -> None:
        """Ask an open connection to close, without waiting (inside the loop)."""
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and not (connection.is_closing or connection.is_closed):
            try:
                connection.close()
            except Exception:  # noqa: BLE001 - the connection is being replaced anyway
                return

    def _disconnect(self) -> None:
        """Close the connection and let the loop run until it is closed (bounded)."""
        closed, self._closed = self._closed, None
        connection = self._connection
        self._disconnect_now()
        if connection is None or closed is None or closed.done() or self._loop.is_closed():
            return
        try:
            self._loop.run_until_complete(asyncio.wait_for(closed, CLOSE_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - a broken connection is dropped either way
            return

    def close(self) -> None:
        self._disconnect()
        if not self._loop.is_closed():
            self._loop.close()
