"""How a message's payload and metadata are laid out on the wire: the `envelope` sink option
(docs/sinks.md, "Envelopes"). Plain string work per message, no CloudEvents SDK objects."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from enum import StrEnum
from json.encoder import encode_basestring

from outbox_migrate.errors import RelayError
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.sinks import NotSent

SPEC_VERSION = "1.0"
DEFAULT_TYPE = "outbox.message"
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"
NOT_TEXT = (
    "payload is not text (non-UTF-8 bytes): a JSON envelope cannot carry it; "
    "use --sink-option envelope=raw"
)
_EXTENSION_NAME = re.compile(r"[a-z0-9]+")
"""What CloudEvents 1.0 allows as an attribute name."""


def content_type(message: Message) -> str:
    """What a raw body is: JSON text from PostgreSQL, or bytes of unknown format."""
    return BINARY_CONTENT_TYPE if isinstance(message.payload, bytes) else JSON_CONTENT_TYPE


def require_text(message: Message, sink: str) -> None:
    """`NotSent` for a payload a JSON envelope cannot carry (it is not text)."""
    if isinstance(message.payload, bytes):
        raise NotSent(f"{sink} {NOT_TEXT}")


def body_bytes(message: Message, envelope: Envelope, sink: str) -> bytes:
    """The body of a sink that sends bytes and headers: the relay's JSON envelope for `json`,
    else (`raw`, CloudEvents binary mode) the payload as stored. Per message: no call
    beyond what the body needs."""
    payload = message.payload
    if envelope is not Envelope.json:
        return payload if isinstance(payload, bytes) else payload.encode()
    if isinstance(payload, bytes):
        raise NotSent(f"{sink} {NOT_TEXT}")
    return message.envelope().encode()


class Envelope(StrEnum):
    raw = "raw"
    json = "json"
    cloudevents = "cloudevents"


def envelope_option(extra: Mapping[str, str], sink: str, default: Envelope) -> Envelope:
    """The sink's `envelope` option; a value that is not one of the three is a usage error."""
    value = extra.get("envelope")
    if value is None:
        return default
    try:
        return Envelope(value.strip().lower())
    except ValueError:
        choices = ", ".join(e.value for e in Envelope)
        raise RelayError(f"sink {sink}: envelope={value!r} is not one of {choices}") from None


class CloudEvents:
    """The CloudEvents 1.0 attributes of messages, for one sink's options."""

    def __init__(self, extra: Mapping[str, str]) -> None:
        self.source: str | None = extra.get("ce_source") or None
        self.default_type: str = extra.get("ce_type") or DEFAULT_TYPE

    def attributes(self, message: Message) -> dict[str, str]:
        """Context attributes in the order the spec lists them (required first)."""
        out = {
            "specversion": SPEC_VERSION,
            "id": str(message.id),
            "source": self.source or f"/outbox/{message.table}",
            "type": message.event_type or self.default_type,
            "datacontenttype": JSON_CONTENT_TYPE,
            "time": message.created,
        }
        if message.key is not None:
            out["subject"] = message.key
        return out

    def binary_headers(
        self, message: Message, prefix: str, *, content_type: bool = True
    ) -> dict[str, str]:
        """Binary content mode: the attributes as prefixed headers, then the relay's headers.
        `content_type=False`: the caller maps `datacontenttype` to its protocol's own header."""
        attributes = self.attributes(message)
        if not content_type:
            del attributes["datacontenttype"]
        out = {prefix + name: value for name, value in attributes.items()}
        out.update(message.headers())
        return out

    def structured(self, message: Message) -> str:
        """Structured content mode: one JSON object; `data` is the payload, verbatim. With no
        headers beside it, the row's headers go inside (docs/sinks.md, "Metadata"), so nothing
        the row holds is dropped; the spec's own attributes win a name clash."""
        attributes = self.attributes(message)
        if message.extra_headers:
            others: dict[str, str] = {}
            for name, value in message.extra_headers:
                if _EXTENSION_NAME.fullmatch(name):
                    attributes.setdefault(name, value)
                else:
                    others.setdefault(name, value)
            if others:
                attributes.setdefault("outboxheaders", json.dumps(others, ensure_ascii=False))
        fields = ",".join(
            f"{encode_basestring(name)}:{encode_basestring(value)}"
            for name, value in attributes.items()
        )
        return f'{{{fields},"data":{message.payload_json()}}}'
