"""NATS JetStream sink: `Nats-Msg-Id` = outbox id, so the broker drops re-sent duplicates.

nats-py is asyncio: each sink owns a private event loop driven from its worker thread. A batch
is pipelined and its acks awaited together (docs/sinks.md, "Sink by sink").

nats-py keeps the connection (TLS, auth, PING/PONG, the socket reader and its parser); the sink
writes the batch's HPUB frames itself, in one piece, through the client's pending buffer.
nats-py's `publish` costs about 25 µs of Python per message (subject and header checks per
call, a coroutine, a bytearray grown per header), more than the relay's whole work on a
message; the frames here are the same bytes (a unit test compares them with nats-py's).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from outbox_migrate.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.sinks import (
    NotSent,
    SinkConfig,
    check_options,
    client,
    event_loop,
    prepare,
    require_internals,
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
HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""The header names nats-py accepts (an RFC 7230 token)."""
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


def publish_subject(subject: str) -> str:
    """The subject, checked once here: the sink writes it into every frame as it is, and a
    blank or a line break in it would break the protocol line (the server closes the
    connection: every batch an outage), a wildcard the server refuses to publish to."""
    tokens = subject.split(".")
    if not subject or re.search(r"\s", subject) or any(t in ("", "*", ">") for t in tokens):
        raise RelayError(
            f"sink nats: --target {subject!r} is not a subject to publish to "
            "(dot-separated names, no blanks, no empty name, no wildcard)"
        )
    return subject


@functools.lru_cache(maxsize=1024)
def header_name(name: str) -> str:
    """The name as nats-py would send it (surrounding blanks dropped), or BadHeaderError as
    nats-py raises it. Cached: a sink sends the same few names over and over."""
    from nats.errors import BadHeaderError

    key = name.strip()
    if key and not HEADER_KEY.fullmatch(key):
        raise BadHeaderError(key)
    return key


def header_block(headers: dict[str, str]) -> bytes:
    """The NATS/1.0 header block nats-py builds for these headers: empty names skipped, values
    stripped, CR and LF in a value made spaces (they would end the header line)."""
    lines = ["NATS/1.0\r\n"]
    for name, value in headers.items():
        key = header_name(name)
        if not key:
            continue
        text = value.strip()
        if "\r" in text or "\n" in text:
            text = text.replace("\r", " ").replace("\n", " ")
        lines.append(f"{key}: {text}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode()


def hpub_frame(subject: bytes, reply: bytes, block: bytes, body: bytes) -> bytes:
    """One HPUB command: the message with its header block and the subject of its ack."""
    size = len(block)
    return b"HPUB %s %s %d %d\r\n%s%s\r\n" % (subject, reply, size, size + len(body), block, body)


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
        nats_client = client(self.name, "nats.aio.client", "nats-py")  # fail early, clearly
        internals = ("_send_command", "_flush_pending")
        require_internals(self.name, "nats-py", nats_client.Client, internals)
        self.config = config
        check_options(self.name, config.extra, ("stream", "create_stream"))
        self.url = require_scheme(self.name, config.url, SCHEMES) or DEFAULT_URL
        self.subject = publish_subject(config.target)
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
        await self._nc.subscribe(f"{acks.inbox}.>", cb=acks.on_reply)
        self._acks, self._js = acks, js
        return js

    def _build(self, message: Message) -> tuple[bytes, bytes]:
        """The message's header block and body, or `NotSent`: too large, or not what the
        envelope can carry."""
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
        try:
            block = header_block(headers)
        except Exception as exc:  # BadHeaderError: a name no NATS header can have
            if not is_permanent(exc):
                raise
            raise NotSent(f"nats {_describe(exc)}") from None
        # The server counts body and header block against max_payload and closes the
        # connection on a larger message, failing the whole batch on every retry.
        size = len(block) + len(body)
        if size > max_payload:
            what = "the server's max_payload, headers included"
            raise NotSent(f"nats {too_large(size, max_payload, self.config, what)}")
        return block, body

    async def _publish(self, batch: Sequence[Message]) -> tuple[dict[MessageId, str], Any]:
        await self._connect()
        nc, acks = self._nc, self._acks
        assert acks is not None  # _connect returned a connected client or raised
        self._max_payload = int(nc.max_payload)
        refused, ready = prepare(batch, self._build)
        waiting = acks.expect([message for message, _ in ready], self._loop)
        subject, prefix = self.subject.encode(), acks.prefix
        frames = [
            hpub_frame(subject, b"%s%d" % (prefix, i), block, body)
            for i, (_, (block, body)) in enumerate(ready)
        ]
        # nats-py's own queue and writer task, as its publish uses (private API: a change of
        # nats-py breaks the unit test that compares frames, not messages). One piece: written
        # 64 frames at a time, as the Redis sink does, it gained nothing measurable here.
        await nc._send_command(b"".join(frames))
        await nc._flush_pending()
        outcomes = await asyncio.wait_for(waiting, self.config.timeout_s)
        return refused, outcomes

    def publish(self, batch: Sequence[Message]) -> None:
        try:
            rejected, outcomes = self._loop.run_until_complete(self._publish(batch))
        except Exception as exc:  # noqa: BLE001 - nats-py raises many types; all mean "not acked"
            self._disconnect()
            raise SinkUnavailable(self.name, _describe(exc)) from None
        for message, outcome in outcomes:
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
    """JetStream acks of one pipelined batch on one connection: the message at position i of
    the batch asks for its ack on `<inbox>.<batch>.<i>`, under one inbox subscription, and the
    batch's future resolves when every one is in: per message, whether JetStream stored it as
    a duplicate, or the error nats-py would have raised.

    Not nats-py's `js.publish` (a task, a timer and a dataclass per message) nor its
    `publish_async`: a message it refuses before sending keeps one of its 4,000 slots for ever,
    so a relay that met 4,000 of them would stall."""

    def __init__(self, inbox: str) -> None:
        self.inbox = inbox
        self.prefix = b""
        self._batch = ""
        self._batches = itertools.count(1)
        self._messages: list[Message] = []
        self._outcomes: list[bool | BaseException | None] = []
        self._missing = 0
        self._done: asyncio.Future[list[tuple[Message, bool | BaseException]]] | None = None

    def expect(
        self, messages: list[Message], loop: asyncio.AbstractEventLoop
    ) -> asyncio.Future[list[tuple[Message, bool | BaseException]]]:
        """A new batch: acks of an earlier one (given up on) are ignored from now on."""
        self._batch = f"{self.inbox}.{next(self._batches)}"
        self.prefix = f"{self._batch}.".encode()
        self._messages, self._outcomes = messages, [None] * len(messages)
        self._missing = len(messages)
        self._done = loop.create_future()
        if not messages:
            self._done.set_result([])
        return self._done

    def _settle(self, subject: str, outcome: bool | BaseException) -> None:
        head, _, position = subject.rpartition(".")
        done = self._done
        if done is None or done.done() or head != self._batch:
            return  # a late ack of a batch given up on
        index = int(position)
        if self._outcomes[index] is not None:
            return  # the server never acks twice; a redelivery must not count twice
        self._outcomes[index] = outcome
        self._missing -= 1
        if self._missing == 0:
            done.set_result(list(zip(self._messages, self._outcomes, strict=True)))  # type: ignore[arg-type]

    async def on_reply(self, msg: Any) -> None:
        headers, data = msg.headers, msg.data
        if headers and headers.get("Status") == NO_RESPONDERS:
            from nats.js.errors import NoStreamResponseError

            self._settle(msg.subject, NoStreamResponseError())
        elif b'"error"' not in data and b'"duplicate"' not in data:
            # A plain PubAck, {"stream":…,"seq":…}: no JSON parser for the usual case.
            self._settle(msg.subject, False)
        else:
            self._settle(msg.subject, _answer(data))


def _answer(data: bytes) -> bool | BaseException:
    """A PubAck that says more than "stored": a duplicate, or an API error."""
    from nats.js.errors import APIError

    try:
        answer = json.loads(data)
    except ValueError as exc:
        return exc
    if "error" not in answer:
        return bool(answer.get("duplicate"))
    error: BaseException
    try:  # nats-py 2.x raises the error's own subclass (BadRequestError, …) from here
        error = APIError.from_error(answer["error"])
    except APIError as raised:
        error = raised
    return error
