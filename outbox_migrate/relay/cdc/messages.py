"""Rows of the unpublished partition as `Message`s, alike for the stream, the backlog and the
mark repair; headers follow the polling relay's rules (relay/claimed.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import RelayError
from outbox_migrate.relay.cdc import pgoutput
from outbox_migrate.relay.claimed import HEADERS_NOT_OBJECT, headers_from_text, text_or_bytes
from outbox_migrate.relay.message import Message, MessageId, UncheckedText
from outbox_migrate.relay.options import CdcOptions
from outbox_migrate.sql import query


@dataclass
class Columns:
    """Positions of the columns a message needs in the partition's Relation message."""

    id: int
    payload: int
    created_at: int | None
    event_type: int | None
    key: int | None
    headers: int | None
    metadata: tuple[tuple[str, int], ...]
    payload_bytea: bool = False
    payload_json: bool = True
    """A json or jsonb payload column: every value is JSON (others are checked when embedded)."""


class MessageBuilder:
    """Finds the message's columns in a relation and builds messages from its rows."""

    def __init__(self, spec: OutboxSpec, options: CdcOptions) -> None:
        self.spec = spec
        self.label = f"{spec.schema}.{spec.partitioned_table}"
        self.name = f"{spec.schema}.{spec.outbox_name}"
        self.bad: dict[MessageId, str] = {}
        """Rows that cannot be sent as they are, with the reason: dead-lettered by delivery."""
        # The optional columns' names: the option when given, else the spec's role.
        self.optional: dict[str, str | None] = {
            "event_type": options.event_type_column or spec.event_type_column or None,
            "key": options.key_column or spec.key_column or None,
            "headers": spec.headers_column or None,
        }

    def columns_for(self, relation: pgoutput.Relation) -> Columns:
        names = {name: i for i, name in enumerate(relation.columns)}
        spec = self.spec
        optional = self.optional
        try:
            return Columns(
                id=names[spec.id_column],
                payload=names[spec.payload_column],
                created_at=names[spec.created_column] if spec.created_column else None,
                event_type=names.get(optional["event_type"] or ""),
                key=names.get(optional["key"] or ""),
                headers=names.get(optional["headers"] or ""),
                metadata=tuple((c, names[c]) for c in spec.metadata_columns),
                payload_bytea=relation.types[names[spec.payload_column]] == BYTEA_OID,
                payload_json=relation.types[names[spec.payload_column]] in JSON_OIDS,
            )
        except KeyError as exc:
            raise RelayError(f"{self.label} has no column {exc.args[0]}") from None

    def message(
        self, columns: Columns, values: Sequence[Any], bad: dict[MessageId, str] | None = None
    ) -> Message:
        """`values`: the stream's text per column, or the backlog SELECT's row. A row that
        cannot be sent as it is goes into `bad` (default: the builder's own, `self.bad`)."""
        created = values[columns.created_at] if columns.created_at is not None else None
        # pgoutput's text ("2026-01-02 03:04:05.6+00") as RFC 3339, like the polling claim's
        created_at = datetime.fromisoformat(created) if created else datetime.now(UTC)
        extra: tuple[tuple[str, str], ...] = ()
        if columns.headers is not None or columns.metadata:
            try:
                extra = _extra_headers(columns, values)
            except ValueError as exc:  # one row's problem, never the stream's
                (self.bad if bad is None else bad)[_id(values[columns.id])] = str(exc)
        return Message(
            _id(values[columns.id]),
            self.name,
            values[columns.event_type] if columns.event_type is not None else None,
            values[columns.key] if columns.key is not None else None,
            _payload(values[columns.payload], columns.payload_bytea, columns.payload_json),
            created_at.isoformat(),
            extra,
        )


BYTEA_OID = 17
JSON_OIDS = (114, 3802)  # json, jsonb


def _id(value: Any) -> int:
    return int(value or 0)


def _payload(value: str | None, bytea: bool, is_json: bool) -> str | bytes:
    """The payload as the polling claim renders it: a bytea's bytes (`\\x` hex from the
    stream) as text when UTF-8, raw bytes otherwise; a text column's value marked unchecked."""
    if value is None:
        return "null"
    if bytea and value.startswith("\\x"):
        return text_or_bytes(bytes.fromhex(value[2:]))
    return value if is_json else UncheckedText(value)


def _extra_headers(columns: Columns, values: Sequence[str | None]) -> tuple[tuple[str, str], ...]:
    """The headers object's entries, then the metadata columns (which win), as polling."""
    raw = values[columns.headers] if columns.headers is not None else None
    parsed = headers_from_text(raw)
    if parsed is None:
        raise ValueError(HEADERS_NOT_OBJECT)
    out = dict(parsed)
    for name, index in columns.metadata:
        value = values[index]
        if value is not None:
            out[name] = value
    return tuple(out.items())


class RowReader:
    """Every column as text, built by the stream's own builder: the backlog and the mark
    repair's dead letters hold exactly what the stream would have sent."""

    def __init__(self, conn: Any, spec: OutboxSpec, columns: list[str], builder: MessageBuilder):
        names = sorted(columns)
        partition = sql.Identifier(spec.schema, spec.unpublished_partition)
        types = dict(
            conn.execute(
                "SELECT attname, atttypid::int8 FROM pg_attribute "
                "WHERE attrelid = to_regclass(%s) AND attname = ANY(%s)",
                (partition.as_string(conn), names),
            ).fetchall()
        )
        self.columns = builder.columns_for(
            pgoutput.Relation(
                0, spec.schema, "", tuple(names), tuple(int(types.get(n, 0)) for n in names)
            )
        )
        self.builder = builder
        texts = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(n)) for n in names)
        ident = sql.Identifier(spec.id_column)
        self._by_ids = query("cdc", "rows-by-ids").compose(columns=texts, table=partition, id=ident)
        self._by_ctids = query("cdc", "rows-by-ctids").compose(columns=texts, table=partition)

    def by_ids(self, conn: Any, ids: list[int]) -> list[Message]:
        """The rows with these ids, in id order (the backlog)."""
        build, columns = self.builder.message, self.columns
        return [build(columns, tuple(r)) for r in conn.execute(self._by_ids, (ids,)).fetchall()]

    def by_ctids(self, conn: Any, tids: list[str]) -> dict[str, Message]:
        """The rows at these ctids, each copy with its own content; the builder's set-aside
        for the stream is left as it was (these are being dead-lettered already)."""
        build, columns = self.builder.message, self.columns
        rows = conn.execute(self._by_ctids, (tids,)).fetchall()
        return {str(r[0]): build(columns, tuple(r[1:]), bad={}) for r in rows}
