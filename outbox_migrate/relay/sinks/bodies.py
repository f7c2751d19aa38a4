"""A message's body as bytes, and the refusal of a payload no JSON envelope can carry.

A bytea payload that is not UTF-8 reaches a sink as `bytes` (`Message.payload`). Sinks that
send bytes (Kafka, AMQP, NATS, Redis, HTTP with a raw or CloudEvents binary body) send it as
it is; a JSON envelope (the relay's own, CloudEvents structured mode, a stdout line) cannot
embed it, and that message is rejected under its id (→ attempts → dead-letter table) while
the rest of the batch is sent — never an outage, and never a mangled body. Pure functions.
"""

from __future__ import annotations

from outbox_migrate.relay.message import Message

BINARY_CONTENT_TYPE = "application/octet-stream"
JSON_CONTENT_TYPE = "application/json"


class NotRepresentable(Exception):
    """The message's payload cannot be embedded in a JSON envelope (it is not text)."""


def is_binary(message: Message) -> bool:
    payload: str | bytes = message.payload
    return isinstance(payload, bytes)


def payload_bytes(message: Message) -> bytes:
    """The payload as bytes, whether it came as JSON text or as raw bytes."""
    payload: str | bytes = message.payload
    return payload if isinstance(payload, bytes) else payload.encode()


def content_type(message: Message) -> str:
    """What a raw body is: JSON text from PostgreSQL, or bytes of unknown format."""
    return BINARY_CONTENT_TYPE if is_binary(message) else JSON_CONTENT_TYPE


def require_text(message: Message) -> None:
    """Raise `NotRepresentable` for a payload a JSON envelope cannot carry."""
    if is_binary(message):
        raise NotRepresentable(unrepresentable_reason())


def unrepresentable_reason() -> str:
    return (
        "payload is not text (non-UTF-8 bytes): a JSON envelope cannot carry it; "
        "use --sink-option envelope=raw"
    )
