"""One outbox row as the relay hands it to a sink. Pure data; no I/O.

The payload stays the JSON text PostgreSQL returned (`payload::text`): sinks send bytes, so
parsing and re-serialising every payload would only cost CPU in the hot loop. The one
exception is a bytea payload that is not UTF-8 (a pickle, say): it stays `bytes`, sent as it
is by sinks that send a body, and refused (`UnrepresentableMessage`) where a JSON envelope
would have to embed it.
"""

from __future__ import annotations

from datetime import datetime
from json.encoder import encode_basestring  # C-accelerated: quotes and escapes one string
from typing import NamedTuple

from outbox_migrate.errors import UnrepresentableMessage

MessageId = int | str
"""An outbox id as the relay carries it: a database id (int), or an application id (uuid,
ULID) as text."""


def _json_text(value: str | None) -> str:
    return "null" if value is None else encode_basestring(value)


class Message(NamedTuple):
    """An outbox row: its id (the de-duplication key downstream), routing fields, payload.

    Fields: `id`; `table`, the relation it was claimed from (flat table or partitioned
    parent); `event_type` and `key` (None when the outbox has no such column); `payload`, the
    JSON text exactly as stored (raw `bytes` only for a bytea payload that is not UTF-8 —
    everything else stays `str`, so the hot loop's types never change); `created`, the
    creation time as RFC 3339 text (the `created_at` property gives it as a datetime);
    `extra_headers`, metadata the outbox carries for the broker (a headers column, chosen
    metadata columns) as (name, value) pairs, in the order they are to be sent. Last and
    defaulted so a claim that selects no metadata builds a `Message` from its first six
    columns unchanged.

    A NamedTuple rather than a frozen dataclass: the relay builds one per row in its hot loop,
    straight from the claim's result tuple (`Message(*row)`: the claim selects the columns in
    this order; `_make` would refuse a row without the defaulted last field), and a frozen
    dataclass's `__init__` costs five times as much — measurable at batch 100
    (bench/relay.py). Immutable either way.
    """

    id: MessageId
    table: str
    event_type: str | None
    key: str | None
    payload: str | bytes
    created: str
    """RFC 3339, as the server rendered it (queries.created_text_expression): sinks send text,
    and formatting a datetime per message cost more than any other field of the envelope."""
    extra_headers: tuple[tuple[str, str], ...] = ()

    @property
    def created_at(self) -> datetime:
        """The creation time as an aware datetime (parsed on demand)."""
        return datetime.fromisoformat(self.created)

    @property
    def payload_bytes(self) -> bytes:
        """The body as bytes: the UTF-8 encoding of a text payload, a raw payload as is."""
        payload = self.payload
        return payload if type(payload) is bytes else payload.encode()  # type: ignore[union-attr]

    def payload_text(self) -> str:
        """The payload as text, for a sink whose format needs text (a JSON envelope, a text
        stream); `UnrepresentableMessage` for a raw bytes payload, which has no faithful text
        form (the relay dead-letters that message rather than guess an encoding)."""
        payload = self.payload
        if type(payload) is bytes:
            raise UnrepresentableMessage(
                "the payload is not UTF-8 text (a bytea payload) and this sink sends text",
                self.id,
            )
        return payload  # type: ignore[return-value]  # str: the only other type

    def envelope(self) -> str:
        """One JSON object (no newline): id, table, event_type, key, created_at, payload.

        Assembled by hand because it runs once per message in the hot loop (json.dumps of a
        dict costs several times more); every string goes through the json module's own
        escaping. The payload is embedded verbatim: it is already valid JSON from PostgreSQL.
        Raises `UnrepresentableMessage` for a raw bytes payload (`payload_text`).
        """
        event_type, key = self.event_type, self.key
        return (
            f'{{"id":{self.id},"table":{encode_basestring(self.table)},"event_type":'
            f'{"null" if event_type is None else encode_basestring(event_type)},"key":'
            f"{'null' if key is None else encode_basestring(key)},"
            f'"created_at":"{self.created}","payload":{self.payload_text()}}}'
        )

    def headers(self) -> dict[str, str]:
        """Broker headers every sink sets: the outbox id, table and, when known, the event type,
        then `extra_headers` in their order (a W3C `traceparent` among them passes unchanged).

        The built-in names win over an extra header of the same name: `outbox-id` is what
        consumers de-duplicate on, and a row's own metadata must not be able to change it.
        """
        out = {"outbox-id": str(self.id), "outbox-table": self.table}
        if self.event_type is not None:
            out["event-type"] = self.event_type
        if self.extra_headers:
            for name, value in self.extra_headers:
                out.setdefault(name, value)
        return out


class TextIdMessage(Message):
    """A message whose id the application supplied (uuid, ULID), claimed as text: the same
    fields, with the id quoted in the envelope. A subclass rather than a type test in
    `Message.envelope`, so integer ids keep their hot path untouched."""

    __slots__ = ()

    def envelope(self) -> str:
        text = super().envelope()
        number = f'{{"id":{self.id},'
        return f'{{"id":{_json_text(str(self.id))},' + text[len(number) :]


__all__ = ["Message", "MessageId", "TextIdMessage"]
