"""NATS JetStream sink: `Nats-Msg-Id` = outbox id, so the broker drops re-sent duplicates.

nats-py is asyncio: each sink owns a private event loop driven from its worker thread. A batch
is pipelined and its acks awaited together (docs/sinks.md, "Sink by sink").
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from outbox_migrate.errors import MessagesRejected, SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.sinks import (
    NotSent,
    SinkConfig,
    client,
    event_loop,
    prepare,
    too_large,
)
from outbox_migrate.relay.sinks.envelopes import (
    CloudEvents,
    Envelope,
    body_bytes,
    content_type,
    envelope_option,
)
from outbox_migrate.relay.sinks.urls import mask_url, require_scheme

DEFAULT_URL = "nats://127.0.0.1:4222"
SCHEMES = ("nats", "tls", "ws", "wss")
_FALSE = frozenset({"0", "false", "no", "off"})
HEADER_BLOCK_BYTES = len(b"NATS/1.0\r\n\r\n")
NO_RESPONDERS = "503"
"""The status header of the reply NATS sends itself when no stream listens on the subject."""
log = logging.getLogger("outbox_migrate.relay.sink.nats")


def stream_name(subject: str) -> str:
    """A valid stream name for a subject (no dots, wildcards or spaces)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", subject).upper()


def is_permanent(exc: BaseException) -> bool:
    """True when NATS refused this one message for what it is: retrying cannot help."""
    from nats.errors import BadHeaderError, BadSubjectError, MaxPayloadError
    from nats.js.errors import APIError, NoStreamResponseError

    if isinstance(exc, MaxPayloadError | NoStreamResponseError | BadHeaderError | BadSubjectError):
        return True
    return isinstance(exc, APIError) and exc.code == 400


def wire_size(body: bytes, headers: dict[str, str], max_payload: int) -> int | None:
    """The size the server counts against `max_payload` — body and header block — when it is
    over, else None. nats-py checks the body alone, and the server closes the connection on a
    larger message, failing the whole batch on every retry. Most messages are judged from their
    length without encoding a header (4 bytes per character at most)."""
    chars = sum(len(name) + len(value) + 4 for name, value in headers.items())
    if len(body) + HEADER_BLOCK_BYTES + 4 * chars <= max_payload:
        return None
    size = len(body) + HEADER_BLOCK_BYTES
    size += sum(len(name.encode()) + len(value.encode()) + 4 for name, value in headers.items())
    return size if size > max_payload else None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    name = type(exc).__name__
    return mask_url(f"{name}: {text}" if text and name not in text else text or name)


async def _quiet_error(exc: Exception) -> None:
    """nats-py's default error callback logs a traceback per failed attempt; one line will do."""
    log.debug("relay.sink_library nats %s", _describe(exc))


class NatsSink:
    name = "nats"

    def __init__(self, config: SinkConfig) -> None:
        client(self.name, "nats", "nats-py")  # fail early with a clear message
        self.config = config
        self.url = require_scheme(self.name, config.url, SCHEMES) or DEFAULT_URL
        self.subject = config.target
        self.stream = config.extra.get("stream") or stream_name(config.target)
        self.create_stream = config.extra.get("create_stream", "true").lower() not in _FALSE
        self.envelope = envelope_option(config.extra, self.name, Envelope.raw)
        self.cloudevents = CloudEvents(config.extra)
        self._loop = event_loop(self.name)
        self._nc: Any = None
        self._js: Any = None
        self._acks: _Acks | None = None
        self._max_payload = 0
        """The `max_payload` the server announced (checked per message, `_build`)."""
        self.duplicates = 0
        """Messages JetStream acknowledged as already stored (re-sent after a crash)."""

    async def _connect(self) -> Any:
        if self._js is not None and self._nc is not None and self._nc.is_connected:
            return self._js
        from nats.aio.client import Client
        from nats.js.errors import NotFoundError

        timeout = self.config.timeout_s
        # Our own client object rather than nats.connect(): when the bounded connect gives
        # up, the half-open transport it made must be closed, not left to the GC.
        self._nc = Client()
        await asyncio.wait_for(
            self._nc.connect(
                self.url,
                connect_timeout=timeout,
                allow_reconnect=False,
                max_reconnect_attempts=1,  # 0 would be "unlimited": a dead server, for ever
                reconnect_time_wait=0,
                error_cb=_quiet_error,
            ),
            timeout,
        )
        js = self._nc.jetstream(timeout=timeout)
        if self.create_stream:
            try:
                await js.stream_info(self.stream)
            except NotFoundError:
                await js.add_stream(name=self.stream, subjects=[self.subject])
        acks = _Acks(self._nc.new_inbox())
        await self._nc.subscribe(f"{acks.inbox}.*", cb=acks.on_reply)
        self._acks, self._js = acks, js
        return js

    def _build(self, message: Message) -> tuple[bytes, dict[str, str]]:
        """The message's body and headers, or `NotSent`: too large, or not what the envelope
        can carry."""
        if self.envelope is Envelope.cloudevents:
            headers = self.cloudevents.binary_headers(message, "ce-")
            headers["ce-datacontenttype"] = content_type(message)
        else:
            headers = message.headers()
        headers["Nats-Msg-Id"] = str(message.id)
        body = body_bytes(message, self.envelope, self.name)
        limit, max_payload = self.config.max_message_bytes, self._max_payload
        if limit is not None and len(body) > limit:
            raise NotSent(f"nats {too_large(len(body), limit, self.config, 'nats')}")
        # A body alone over it is nats-py's to refuse (MaxPayloadError, before sending).
        size = wire_size(body, headers, max_payload) if len(body) <= max_payload else None
        if size is not None:
            what = "the server's max_payload, headers included"
            raise NotSent(f"nats {too_large(size, max_payload, self.config, what)}")
        return body, headers

    async def _publish(
        self, batch: Sequence[Message]
    ) -> tuple[dict[MessageId, str], list[Message], list[Any]]:
        await self._connect()
        nc, acks, subject = self._nc, self._acks, self.subject
        assert acks is not None
        self._max_payload = int(nc.max_payload)
        refused, ready = prepare(batch, self._build)
        pending: list[asyncio.Future[bool]] = []
        for _, (body, headers) in ready:
            reply, future = acks.expect(self._loop)
            try:
                await nc.publish(subject, body, reply=reply, headers=headers)
            except Exception as exc:  # noqa: BLE001 - refused before sending: its outcome
                acks.forget(reply)
                future.set_exception(exc)
            pending.append(future)
        outcomes = await asyncio.wait_for(
            asyncio.gather(*pending, return_exceptions=True), self.config.timeout_s
        )
        return refused, [message for message, _ in ready], list(outcomes)

    def publish(self, batch: Sequence[Message]) -> None:
        try:
            rejected, ready, outcomes = self._loop.run_until_complete(self._publish(batch))
        except Exception as exc:  # noqa: BLE001 - nats-py raises many types; all mean "not acked"
            self._disconnect()
            raise SinkUnavailable(self.name, _describe(exc)) from None
        for message, outcome in zip(ready, outcomes, strict=True):
            if not isinstance(outcome, BaseException):
                self.duplicates += outcome
            elif is_permanent(outcome):
                rejected[message.id] = f"nats {_describe(outcome)}"
            else:
                self._disconnect()
                raise SinkUnavailable(self.name, _describe(outcome))
        if rejected:
            raise MessagesRejected(self.name, rejected)

    def close(self) -> None:
        self._disconnect()
        if not self._loop.is_closed():
            self._loop.close()

    def _disconnect(self) -> None:
        nc, self._nc, self._js, self._acks = self._nc, None, None, None
        if nc is None:
            return
        try:
            self._loop.run_until_complete(asyncio.wait_for(nc.close(), self.config.timeout_s))
        except Exception:  # noqa: BLE001 - closing a broken connection we discard anyway
            log.debug("relay.sink_library nats close failed")
        transport = getattr(nc, "_transport", None)
        if transport is not None:  # a connect cut short may leave it open under a closed nc
            try:
                transport.close()
                self._loop.run_until_complete(asyncio.sleep(0))  # let the socket close now
            except Exception:  # noqa: BLE001 - best effort on a connection being discarded
                return


class _Acks:
    """JetStream acks of pipelined publishes on one connection: a reply subject and a future
    per message, under one inbox subscription. A future resolves to whether JetStream stored
    the message as a duplicate, or fails with the error nats-py would have raised.

    Not nats-py's `js.publish` (a task, a timer and a dataclass per message) nor its
    `publish_async`: a message it refuses before sending keeps one of its 4,000 slots for ever,
    so a relay that met 4,000 of them would stall. Here a refused message's future is dropped."""

    def __init__(self, inbox: str) -> None:
        self.inbox = inbox
        self._next = itertools.count(1)
        self._waiting: dict[str, asyncio.Future[bool]] = {}

    def expect(self, loop: asyncio.AbstractEventLoop) -> tuple[str, asyncio.Future[bool]]:
        reply = f"{self.inbox}.{next(self._next)}"
        future: asyncio.Future[bool] = loop.create_future()
        self._waiting[reply] = future
        return reply, future

    def forget(self, reply: str) -> None:
        self._waiting.pop(reply, None)

    async def on_reply(self, msg: Any) -> None:
        future = self._waiting.pop(msg.subject, None)
        if future is None or future.done():  # a late ack of a batch given up on
            return
        from nats.js.errors import APIError, NoStreamResponseError

        headers = msg.headers
        if headers and headers.get("Status") == NO_RESPONDERS:
            future.set_exception(NoStreamResponseError())
            return
        try:
            answer = json.loads(msg.data)
        except ValueError as exc:
            future.set_exception(exc)
            return
        if "error" in answer:
            try:  # nats-py 2.x raises the error's own subclass (BadRequestError, …) from here
                error = APIError.from_error(answer["error"])
            except APIError as raised:
                error = raised
            future.set_exception(error)
        else:
            future.set_result(bool(answer.get("duplicate")))
