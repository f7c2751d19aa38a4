"""Every statement on the attempts and dead-letter tables, for both relays (relay/bad_rows.py).

One place says how a failure is counted and a message kept, so the two relays cannot drift
apart. Ids are `int8`, or `text` with application ids (`text_ids`).
"""

from __future__ import annotations

from collections.abc import Collection

from psycopg import sql

from outbox_migrate.patterns.kinds.dead_letter_tables import (
    create_attempts,
    create_dead_letter,
    id_sql_type,
)
from outbox_migrate.sql import query

__all__ = ["create_attempts", "create_dead_letter", "id_sql_type"]  # the migration's DDL

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


def _named(name: str, schema: str, table: str, text_ids: bool = False, **parts: sql.Composable
           ) -> sql.Composed:  # fmt: skip
    return query("relay", name).compose(
        table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids), **parts
    )


def columns_of(schema: str, table: str) -> sql.Composed:
    """Each column of a table and its type as `format_type` spells it (params: none)."""
    reg = sql.Literal(sql.Identifier(schema, table).as_string(None))
    return query("relay", "columns-of").compose(reg=reg)


def _history(history: bool, alias: str = "") -> sql.SQL:
    """The reasons and deliveries columns, or stand-ins where an older table lacks them."""
    if not history:
        return sql.SQL("NULL::text[], 0")
    return sql.SQL(f"{alias}reasons, {alias}delivered")


def attempted(schema: str, table: str, history: bool = True) -> sql.Composed:
    """Counters on record (param: source): id, attempts, last error, reasons, deliveries."""
    return _named("attempted", schema, table, history=_history(history))


def attempts_of(schema: str, table: str, text_ids: bool, history: bool = True) -> sql.Composed:
    """The counters of some ids (params: source, ids), as `attempted`."""
    return _named("attempts-of", schema, table, text_ids, history=_history(history))


def count_attempts(schema: str, table: str, text_ids: bool, history: bool = True) -> sql.Composed:
    """Add one failure per id (params: source, ids, errors, delivered 0/1); returns attempts,
    reasons and deliveries. Each id once: an upsert cannot touch one row twice (21000)."""
    if not history:
        return _named("count-attempts-without-history", schema, table, text_ids)
    return _named("count-attempts", schema, table, text_ids, kept=sql.Literal(REASONS_KEPT))


def note_attempts(schema: str, table: str, text_ids: bool, history: bool = True) -> sql.Composed:
    """The reason of attempts counted beforehand (params: source, ids, errors), replacing
    the careful count's placeholder; returns as `count_attempts`."""
    reasons = sql.SQL(", reasons = a.reasons[:cardinality(a.reasons) - 1] || r.error")
    reasons = reasons if history else sql.SQL("")
    return _named("note-attempts", schema, table, text_ids, reasons=reasons,
                  history=_history(history, "a."))  # fmt: skip


def uncount_attempts(schema: str, table: str, text_ids: bool) -> sql.Composed:
    """Take back one attempt per id (params: source, ids); returns each id's attempts left."""
    return _named("uncount-attempts", schema, table, text_ids)


def forget_attempts(schema: str, table: str, text_ids: bool) -> sql.Composed:
    """Drop the counters of published or dead-lettered ids (params: source, ids)."""
    return _named("forget-attempts", schema, table, text_ids)


def insert_dead_letter(
    schema: str, table: str, *, raw: bool, extras: Collection[str] = HISTORY_COLUMNS
) -> sql.Composed:
    """Keep one message; returns a row only when written. `extras`: which HISTORY_COLUMNS
    the table has. The payload is an untyped parameter, so an older json table still takes
    it."""
    names = [PAYLOAD_BYTES_COLUMN] if raw else []
    values = ["%(raw)s"] if raw else []
    for column, value in HISTORY_COLUMNS.items():
        if column in extras:
            names.append(column)
            values.append(value)
    return _named(
        "insert-dead-letter", schema, table,
        columns=sql.SQL("").join(sql.SQL(", {}").format(sql.Identifier(n)) for n in names),
        values=sql.SQL("").join(sql.SQL(", " + v) for v in values),
    )  # fmt: skip


def dead_letters_of(schema: str, table: str) -> sql.Composed:
    """The dead letters of one id, copies included: each label and whether it holds exactly
    this message."""
    return _named("dead-letters-of", schema, table)
