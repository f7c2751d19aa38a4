"""One outbox row as the relay hands it to a sink; pure data, no I/O. The payload stays the
text PostgreSQL returned (parsing it would only cost CPU), or `bytes` when not UTF-8.
"""

from __future__ import annotations

import json
from datetime import datetime
from json.encoder import encode_basestring  # C-accelerated: quotes and escapes one string
from typing import NamedTuple

from outbox_migrate.errors import UnrepresentableMessage

MessageId = int | str  # an application id (uuid, ULID) as text


def _json_text(value: str | None) -> str:
    return "null" if value is None else encode_basestring(value)


class UncheckedText(str):
    """A payload from a column that does not promise JSON (text, or bytea that is UTF-8). Its
    own type, so an envelope that embeds the payload as JSON checks it first (`payload_json`),
    while a json or jsonb payload keeps the unchecked hot path (`type(payload) is str`)."""

    __slots__ = ()


NOT_JSON = (
    "the payload is not JSON (its column is not json or jsonb) and this envelope embeds it as "
    "JSON: send it as it is with --sink-option envelope=raw"
)


class Message(NamedTuple):
    """An outbox row. A NamedTuple, built per row from the claim's tuple: a frozen dataclass's
    `__init__` costs several times as much. `extra_headers` are (name, value) pairs in sending
    order, last and defaulted so a claim without metadata builds one from six columns."""

    id: MessageId
    table: str
    event_type: str | None
    key: str | None
    payload: str | bytes
    created: str
    """RFC 3339, as the server rendered it (queries.created_text_expression)."""
    extra_headers: tuple[tuple[str, str], ...] = ()

    @property
    def created_at(self) -> datetime:
        return datetime.fromisoformat(self.created)

    @property
    def payload_bytes(self) -> bytes:
        """The body as bytes: the UTF-8 encoding of a text payload, a raw payload as is."""
        payload = self.payload
        return payload if type(payload) is bytes else payload.encode()  # type: ignore[union-attr]

    def payload_text(self) -> str:
        """The payload as text; `UnrepresentableMessage` for raw bytes, which have no faithful
        text form (dead-lettered rather than guess an encoding)."""
        payload = self.payload
        if type(payload) is bytes:
            raise UnrepresentableMessage(
                "the payload is not UTF-8 text (a bytea payload) and this sink sends text",
                self.id,
            )
        return payload  # type: ignore[return-value]  # str: the only other type

    def payload_json(self) -> str:
        """The payload as a JSON text to embed verbatim; `UnrepresentableMessage` for one that
        is not JSON (a text column holds any text: embedded as it is, it made the whole
        document invalid, and was acknowledged and marked) or not text."""
        text = self.payload_text()
        if type(text) is UncheckedText:
            try:
                json.loads(text)
            except ValueError:
                raise UnrepresentableMessage(NOT_JSON, self.id) from None
        return text

    def envelope(self) -> str:
        """One JSON object: id, table, event_type, key, created_at, payload (verbatim: JSON from
        PostgreSQL, or checked first: `payload_json`). By hand: json.dumps per message costs
        several times more."""
        event_type, key, payload = self.event_type, self.key, self.payload
        # The check inline: a call per message only for payloads of other types than jsonb.
        text = payload if type(payload) is str else self.payload_json()
        return (
            f'{{"id":{self.id},"table":{encode_basestring(self.table)},"event_type":'
            f'{"null" if event_type is None else encode_basestring(event_type)},"key":'
            f"{'null' if key is None else encode_basestring(key)},"
            f'"created_at":"{self.created}","payload":{text}}}'
        )

    def headers(self) -> dict[str, str]:
        """Broker headers: outbox id, table, event type, then `extra_headers`. The built-in
        names win: consumers de-duplicate on `outbox-id`, which a row must not change."""
        out = {"outbox-id": str(self.id), "outbox-table": self.table}
        if self.event_type is not None:
            out["event-type"] = self.event_type
        if self.extra_headers:
            for name, value in self.extra_headers:
                out.setdefault(name, value)
        return out


class TextIdMessage(Message):
    """An application id, quoted in the envelope; a subclass, so integer ids keep their hot
    path untouched."""

    __slots__ = ()

    def envelope(self) -> str:
        text = super().envelope()
        number = f'{{"id":{self.id},'
        return f'{{"id":{_json_text(str(self.id))},' + text[len(number) :]


__all__ = ["Message", "MessageId", "TextIdMessage", "UncheckedText"]
