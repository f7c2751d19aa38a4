"""Every statement on the attempts and dead-letter tables, for both relays (relay/bad_rows.py).

Apart from relay/queries.py (the claim, the mark, the shards): one place says how a failure is
counted and how a message is kept, so the polling and the CDC relay cannot drift apart again.
Builders return inert `Composed` objects; identifiers go through `sql.Identifier`, values are
bound parameters. Ids are `int8`, or `text` for an outbox with application ids (`text_ids`).
"""

from __future__ import annotations

from psycopg import sql

PAYLOAD_BYTES_COLUMN = "payload_bytes"
"""Dead-letter column for a raw (non-UTF-8 bytea) payload; `payload` then holds its hex text."""


def id_sql_type(text_ids: bool) -> sql.SQL:
    """How ids are stored in the attempts and dead-letter tables."""
    return sql.SQL("text" if text_ids else "int8")


def create_dead_letter(schema: str, table: str, text_ids: bool = False) -> sql.Composed:
    """Where messages go after failing `max_attempts` times; nothing is lost. A payload that
    is not UTF-8 (bytea) is kept in `payload_bytes`, `payload` then holding its hex text."""
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {table} ("
        "source_table text NOT NULL, id {id_type} NOT NULL, event_type text, message_key text, "
        "payload text NOT NULL, payload_bytes bytea, created_at timestamptz NOT NULL, "
        "attempts int NOT NULL, "
        "last_error text NOT NULL, dead_at timestamptz NOT NULL DEFAULT now(), "
        "PRIMARY KEY (source_table, id))"
    ).format(table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids))


def create_attempts(schema: str, table: str, text_ids: bool = False) -> sql.Composed:
    """Failures so far of messages not yet published or dead-lettered: survives relay
    restarts, so a message that makes the relay crash-loop still reaches the dead letters."""
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {table} ("
        "source_table text NOT NULL, id {id_type} NOT NULL, attempts int NOT NULL, "
        "last_error text NOT NULL, updated_at timestamptz NOT NULL DEFAULT now(), "
        "PRIMARY KEY (source_table, id))"
    ).format(table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids))


def attempted(schema: str, table: str) -> sql.Composed:
    """Counters on record (param: source): id, attempts, last error — read at a start."""
    return sql.SQL(
        "SELECT id, attempts, last_error FROM {table} WHERE source_table = %(source)s"
    ).format(table=sql.Identifier(schema, table))


def attempts_of(schema: str, table: str, text_ids: bool) -> sql.Composed:
    """The counters of some ids (params: source, ids), as `attempted`."""
    return sql.SQL(
        "SELECT id, attempts, last_error FROM {table} WHERE source_table = %(source)s "
        "AND id = ANY(%(ids)s::{id_type}[])"
    ).format(table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids))


def count_attempts(schema: str, table: str, text_ids: bool) -> sql.Composed:
    """Add one failure per id (params: source, ids, errors text[]); returns each id's
    attempts so far. Each id must appear once: an upsert cannot touch one row twice
    (SQLSTATE 21000), so two copies of an id share one attempt (relay/bad_rows.py)."""
    return sql.SQL(
        "INSERT INTO {table} AS a (source_table, id, attempts, last_error) "
        "SELECT %(source)s, r.id, 1, r.error "
        "FROM unnest(%(ids)s::{id_type}[], %(errors)s::text[]) AS r(id, error) "
        "ON CONFLICT (source_table, id) DO UPDATE SET attempts = a.attempts + 1, "
        "last_error = excluded.last_error, updated_at = now() RETURNING a.id, a.attempts"
    ).format(table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids))


def note_attempts(schema: str, table: str, text_ids: bool) -> sql.Composed:
    """The reason of attempts counted beforehand (params: source, ids, errors); returns each
    id's attempts so far."""
    return sql.SQL(
        "UPDATE {table} AS a SET last_error = r.error, updated_at = now() "
        "FROM unnest(%(ids)s::{id_type}[], %(errors)s::text[]) AS r(id, error) "
        "WHERE a.source_table = %(source)s AND a.id = r.id RETURNING a.id, a.attempts"
    ).format(table=sql.Identifier(schema, table), id_type=id_sql_type(text_ids))


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


def insert_dead_letter(schema: str, table: str, *, raw: bool) -> sql.Composed:
    """Keep one message (params: source, id, event_type, key, payload, created_at, attempts,
    error, and raw when `raw`); returns a row only when it was written. The payload goes in
    as an untyped parameter: the table keeps it as text whatever the outbox's payload type,
    and a table created as json by an earlier version still takes JSON payloads."""
    columns = sql.SQL(", {}").format(sql.Identifier(PAYLOAD_BYTES_COLUMN)) if raw else sql.SQL("")
    value = sql.SQL(", %(raw)s") if raw else sql.SQL("")
    return sql.SQL(
        "INSERT INTO {table} (source_table, id, event_type, message_key, payload{columns}, "
        "created_at, attempts, last_error) VALUES (%(source)s, %(id)s, %(event_type)s, "
        "%(key)s, %(payload)s{value}, %(created_at)s, %(attempts)s, %(error)s) "
        "ON CONFLICT (source_table, id) DO NOTHING RETURNING true"
    ).format(table=sql.Identifier(schema, table), columns=columns, value=value)


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
