"""Claimed rows → `Message`s, and the bad rows apart with a reason: what can fail row by row
is judged here, never in the claim, so one row never fails its batch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from outbox_migrate.relay import queries
from outbox_migrate.relay.message import Message, MessageId, UncheckedText

HEADERS_NOT_OBJECT = "the headers column does not hold a JSON object"
JSON_TYPES = ("json", "jsonb")
"""Payload columns whose every value is JSON: embedded in a JSON envelope unchecked."""


class BadRow(NamedTuple):
    """A claimed row the relay cannot send: the message as far as it could be built, and why."""

    message: Message
    reason: str


class Claimed(NamedTuple):
    messages: list[Message]
    bad: list[BadRow]


def messages(rows: Sequence[Any], message: type[Message], columns: queries.Columns) -> Claimed:
    """The claimed rows as messages, in claim order, and the bad rows apart. `tuple.__new__`:
    the NamedTuple's own `__new__` is a Python function, and this runs per message."""
    new = tuple.__new__
    raw = columns.payload_type == "bytea"
    unchecked = columns.payload_type not in JSON_TYPES
    if not columns.carries_headers and not unchecked:
        return Claimed([new(message, (r[0], r[1], r[2], r[3], r[4], r[5], ())) for r in rows], [])
    at = queries.CLAIM_HEADERS_COLUMN
    text_at = queries.CLAIM_TEXT_HEADERS_COLUMN if columns.text_headers else 0
    checked = bool(columns.headers)
    out: list[Message] = []
    bad: list[BadRow] = []
    for r in rows:
        payload = text_or_bytes(r[4]) if raw else UncheckedText(r[4]) if unchecked else r[4]
        reason = ""
        extra: tuple[tuple[str, str], ...] = ()
        if len(r) > at:
            pairs = r[at]
            if text_at:
                parsed = headers_from_text(r[text_at])
                if parsed is None:
                    reason = HEADERS_NOT_OBJECT
                else:
                    # The metadata columns win over a same-named entry, as in the claim.
                    names = {k for k, _ in pairs}
                    extra = tuple(p for p in parsed if p[0] not in names) + tuple(
                        (k, v) for k, v in pairs
                    )
            elif pairs is None and checked:
                reason = HEADERS_NOT_OBJECT
            else:
                extra = tuple((k, v) for k, v in pairs or ())
        built = new(message, (r[0], r[1], r[2], r[3], payload, r[5], extra))
        if reason:
            bad.append(BadRow(built, reason))
        else:
            out.append(built)
    return Claimed(out, bad)


def text_or_bytes(body: bytes) -> str | bytes:
    try:
        return UncheckedText(body.decode())
    except UnicodeDecodeError:
        return bytes(body)


def headers_from_text(text: str | None) -> list[tuple[str, str]] | None:
    """A text headers value as `jsonb_each_text` would render it; None if not an object.
    Both relays judge a row here alike."""
    if text is None:
        return []
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if value is None:
        return []
    if not isinstance(value, dict):
        return None
    return [
        (str(k), v if isinstance(v, str) else json.dumps(v))
        for k, v in value.items()
        if v is not None
    ]


def ids(bad: Sequence[BadRow]) -> list[MessageId]:
    return [b.message.id for b in bad]
