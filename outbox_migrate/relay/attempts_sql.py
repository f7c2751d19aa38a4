"""Every statement on the attempts and dead-letter tables, for both relays (relay/bad_rows.py).

Apart from relay/queries.py (the claim, the mark, the shards): one place says how a failure is
counted and how a message is kept, so the polling and the CDC relay cannot drift apart again.
Builders return inert `Composed` objects; identifiers go through `sql.Identifier`, values are
bound parameters. Ids are `int8`, or `text` for an outbox with application ids (`text_ids`).
"""

from __future__ import annotations

from collections.abc import Collection

from psycopg import sql

from outbox_migrate.patterns.kinds.dead_letter_tables import (
    create_attempts,
    create_dead_letter,
    id_sql_type,
)

__all__ = ["create_attempts", "create_dead_letter", "id_sql_type"]
"""The tables' DDL is the migration's step's (patterns/kinds/dead_letter_tables.py): the relay
creates the very same tables when it may."""

PAYLOAD_BYTES_COLUMN = "payload_bytes"
"""Dead-letter column for a raw (non-UTF-8 bytea) payload; `payload` then holds its hex text."""


DEAD_LETTER_COLUMNS: dict[str, str] = {
    "source_table": "text", "id": "", "event_type": "text", "message_key": "text",
    "payload": "text", "payload_bytes": "bytea", "created_at": "timestamp with time zone",
    "attempts": "integer", "last_error": "text", "dead_at": "timestamp with time zone",
    "headers": "jsonb", "reasons": "text[]", "delivered": "integer",
}  # fmt: skip
"""What the relay writes to a dead-letter table, by column, and its type ("": the ids')."""
ATTEMPTS_COLUMNS: dict[str, str] = {
    "source_table": "text", "id": "", "attempts": "integer", "last_error": "text",
    "updated_at": "timestamp with time zone", "reasons": "text[]", "delivered": "integer",
}  # fmt: skip
ADDED_COLUMNS: dict[str, str] = {
    "headers": "jsonb", "reasons": "text[] NOT NULL DEFAULT '{}'",
    "delivered": "int NOT NULL DEFAULT 0", "payload_bytes": "bytea",
}  # fmt: skip
"""Columns a table made by an earlier version may lack, as `ADD COLUMN` declares them."""
HISTORY_COLUMNS: dict[str, str] = {
    "headers": "%(headers)s::jsonb", "reasons": "%(reasons)s::text[]",
    "delivered": "%(delivered)s",
}  # fmt: skip
"""Dead-letter columns an earlier version's table may lack, and the values they take."""
REASONS_KEPT = 20
"""An attempts row keeps the last this many reasons (a crash loop must not grow it for ever)."""


def columns_of(schema: str, table: str) -> sql.Composed:
    """Each column of a table and its type as `format_type` spells it (params: none)."""
    return sql.SQL(
        "SELECT attname::text, format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = {reg}::regclass AND attnum > 0 AND NOT attisdropped"
    ).format(reg=sql.Literal(sql.Identifier(schema, table).as_string(None)))


def _history(history: bool, alias: str = "") -> sql.SQL:
    """The reasons and deliveries columns, or stand-ins where an attempts table of an earlier
    version lacks them (the relay may not add them: `FailedMessages.prepare`)."""
    if not history:
        return sql.SQL("NULL::text[], 0")
    return sql.SQL(f"{alias}reasons, {alias}delivered")


def attempted(schema: str, table: str, history: bool = True) -> sql.Composed:
    """Counters on record (param: source): id, attempts, last error, reasons, deliveries —
    read at a start."""
    return sql.SQL(
        "SELECT id, attempts, last_error, {history} FROM {table} WHERE source_table = %(source)s"
    ).format(table=sql.Identifier(schema, table), history=_history(history))


def attempts_of(schema: str, table: str, text_ids: bool, history: bool = True) -> sql.Composed:
    """The counters of some ids (params: source, ids), as `attempted`."""
    return sql.SQL(
        "SELECT id, attempts, last_error, {history} FROM {table} "
        "WHERE source_table = %(source)s AND id = ANY(%(ids)s::{id_type}[])"
    ).format(table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids),
             history=_history(history))  # fmt: skip


def count_attempts(schema: str, table: str, text_ids: bool, history: bool = True) -> sql.Composed:
    """Add one failure per id (params: source, ids, errors text[], delivered: 1 when the sink
    had acknowledged the messages, else 0); returns each id's attempts so far, reasons (the
    last REASONS_KEPT) and deliveries. Each id must appear once: an upsert cannot touch one
    row twice (SQLSTATE 21000), so two copies of an id share one attempt (relay/bad_rows.py)."""
    if not history:
        return sql.SQL(
            "INSERT INTO {table} AS a (source_table, id, attempts, last_error) "
            "SELECT %(source)s, r.id, 1, r.error "
            "FROM unnest(%(ids)s::{id_type}[], %(errors)s::text[]) AS r(id, error) "
            "ON CONFLICT (source_table, id) DO UPDATE SET attempts = a.attempts + 1, "
            "last_error = excluded.last_error, updated_at = now() "
            "RETURNING a.id, a.attempts, NULL::text[], 0"
        ).format(table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids))
    return sql.SQL(
        "INSERT INTO {table} AS a (source_table, id, attempts, last_error, reasons, delivered) "
        "SELECT %(source)s, r.id, 1, r.error, ARRAY[r.error], %(delivered)s "
        "FROM unnest(%(ids)s::{id_type}[], %(errors)s::text[]) AS r(id, error) "
        "ON CONFLICT (source_table, id) DO UPDATE SET attempts = a.attempts + 1, "
        "last_error = excluded.last_error, updated_at = now(), "
        "reasons = (a.reasons || excluded.reasons)"
        "[greatest(1, cardinality(a.reasons) + 2 - {kept}):], "
        "delivered = a.delivered + excluded.delivered "
        "RETURNING a.id, a.attempts, a.reasons, a.delivered"
    ).format(
        table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids),
        kept=sql.Literal(REASONS_KEPT),
    )  # fmt: skip


def note_attempts(schema: str, table: str, text_ids: bool, history: bool = True) -> sql.Composed:
    """The reason of attempts counted beforehand (params: source, ids, errors); returns each
    id's attempts so far, reasons and deliveries (the reason replaces the last one kept, which
    the careful count wrote as a placeholder)."""
    reasons = sql.SQL(", reasons = a.reasons[:cardinality(a.reasons) - 1] || r.error")
    return sql.SQL(
        "UPDATE {table} AS a SET last_error = r.error, updated_at = now(){reasons} "
        "FROM unnest(%(ids)s::{id_type}[], %(errors)s::text[]) AS r(id, error) "
        "WHERE a.source_table = %(source)s AND a.id = r.id "
        "RETURNING a.id, a.attempts, {history}"
    ).format(
        table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids),
        reasons=reasons if history else sql.SQL(""), history=_history(history, "a."),
    )  # fmt: skip


def uncount_attempts(schema: str, table: str, text_ids: bool) -> sql.Composed:
    """Take back one attempt per id (params: source, ids); returns each id's attempts left."""
    return sql.SQL(
        "UPDATE {table} SET attempts = attempts - 1 WHERE source_table = %(source)s "
        "AND id = ANY(%(ids)s::{id_type}[]) RETURNING id, attempts"
    ).format(table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids))


def forget_attempts(schema: str, table: str, text_ids: bool) -> sql.Composed:
    """Drop the counters of ids that were published or dead-lettered (params: source, ids);
    a counter taken back to zero goes too."""
    return sql.SQL(
        "DELETE FROM {table} WHERE source_table = %(source)s AND id = ANY(%(ids)s::{id_type}[])"
    ).format(table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids))


def insert_dead_letter(
    schema: str, table: str, *, raw: bool, extras: Collection[str] = HISTORY_COLUMNS
) -> sql.Composed:
    """Keep one message (params: source, id, event_type, key, payload, created_at, attempts,
    error, headers — jsonb text of [name, value] pairs —, reasons, delivered, and raw when
    `raw`); returns a row only when it was written. `extras`: which of HISTORY_COLUMNS the
    table has (one of an earlier version the relay may not alter lacks them). The payload
    goes in as an untyped parameter: the table keeps it as text whatever the outbox's payload
    type, and a table created as json by an earlier version still takes JSON payloads."""
    names = [PAYLOAD_BYTES_COLUMN] if raw else []
    values = ["%(raw)s"] if raw else []
    for column, value in HISTORY_COLUMNS.items():
        if column in extras:
            names.append(column)
            values.append(value)
    columns = sql.SQL("").join(sql.SQL(", {}").format(sql.Identifier(n)) for n in names)
    return sql.SQL(
        "INSERT INTO {table} (source_table, id, event_type, message_key, payload, "
        "created_at, attempts, last_error{columns}) VALUES (%(source)s, %(id)s, "
        "%(event_type)s, %(key)s, %(payload)s, %(created_at)s, %(attempts)s, %(error)s{values}) "
        "ON CONFLICT (source_table, id) DO NOTHING RETURNING true"
    ).format(
        table=sql.Identifier(schema, table),
        columns=columns,
        values=sql.SQL("").join(sql.SQL(", " + v) for v in values),
    )


def dead_letters_of(schema: str, table: str) -> sql.Composed:
    """The dead letters kept for one id of a source, its copies included (params: id,
    source, copies — the copies' label prefix): each label and whether it holds exactly
    this message (params: event_type, key, payload, created_at)."""
    return sql.SQL(
        "SELECT source_table, event_type IS NOT DISTINCT FROM %(event_type)s "
        "AND message_key IS NOT DISTINCT FROM %(key)s AND payload::text = %(payload)s::text "
        "AND created_at = %(created_at)s FROM {table} WHERE id = %(id)s "
        "AND (source_table = %(source)s OR starts_with(source_table, %(copies)s))"
    ).format(table=sql.Identifier(schema, table))
