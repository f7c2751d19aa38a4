"""Reference outbox schemas for tests, benchmarks and the simulator.

The flat table is the spec's traditional outbox plus two columns relays commonly need
(`event_type` for headers, `message_key` for broker keys / de-duplication). The partitioned
layout is the spec's target, built directly here (the migration builds it through the
catalog's steps instead).
"""

from __future__ import annotations

from typing import Any

from psycopg import Connection, sql

from outbox_migrate.config import OutboxSpec


def _names(spec: OutboxSpec) -> dict[str, sql.Composable]:
    return {
        "schema": sql.Identifier(spec.schema),
        "table": sql.Identifier(spec.schema, spec.table),
        "parent": sql.Identifier(spec.schema, spec.partitioned_table),
        "unpublished": sql.Identifier(spec.schema, spec.unpublished_partition),
        "published": sql.Identifier(spec.schema, spec.published_partition),
        "id": sql.Identifier(spec.id_column),
        "published_at": sql.Identifier(spec.published_column),
        "flat_index": sql.Identifier(f"{spec.table}_unpublished_{spec.id_column}_idx"),
        "unpublished_index": sql.Identifier(spec.unpublished_index),
    }


COLUMNS = """
    {id} int8 GENERATED ALWAYS AS IDENTITY{identity_options},
    event_type text NOT NULL DEFAULT 'event',
    message_key text,
    payload json NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    {published_at} timestamptz
"""


def create_flat_outbox(conn: Connection[Any], spec: OutboxSpec | None = None) -> None:
    """The traditional outbox: one table, a partial index on unpublished ids."""
    spec = spec or OutboxSpec()
    n = _names(spec)
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {schema}").format(**n))
    conn.execute(
        sql.SQL("CREATE TABLE {table} (" + COLUMNS + ", PRIMARY KEY ({id}))").format(
            identity_options=sql.SQL(""), **n
        )
    )
    conn.execute(
        sql.SQL("CREATE INDEX {flat_index} ON {table} ({id}) WHERE {published_at} IS NULL").format(
            **n
        )
    )


def create_partitioned_outbox(
    conn: Connection[Any], spec: OutboxSpec | None = None, *, start: int = 1
) -> None:
    """The revamped outbox: LIST (published_at), NULL partition + DEFAULT partition."""
    spec = spec or OutboxSpec()
    n = _names(spec)
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {schema}").format(**n))
    conn.execute(
        sql.SQL(
            "CREATE TABLE {parent} (" + COLUMNS + ") PARTITION BY LIST ({published_at})"
        ).format(identity_options=sql.SQL(" (START {})").format(sql.Literal(start)), **n)
    )
    conn.execute(
        sql.SQL("CREATE TABLE {unpublished} PARTITION OF {parent} FOR VALUES IN (NULL)").format(**n)
    )
    conn.execute(sql.SQL("CREATE TABLE {published} PARTITION OF {parent} DEFAULT").format(**n))
    conn.execute(sql.SQL("CREATE INDEX {unpublished_index} ON {unpublished} ({id})").format(**n))


def insert_rows(
    conn: Connection[Any],
    table: str,
    count: int,
    *,
    spec: OutboxSpec | None = None,
    published: bool = False,
    payload_bytes: int = 16,
) -> None:
    """Bulk-insert `count` rows into `table` (one statement), published or not."""
    spec = spec or OutboxSpec()
    conn.execute(
        sql.SQL(
            "INSERT INTO {table} (event_type, message_key, payload, {published_at}) "
            "SELECT 'event', 'k-' || g || '-' || md5(random()::text), "
            "json_build_object('n', g, 'pad', repeat('x', {pad})), "
            "CASE WHEN {published} THEN now() END FROM generate_series(1, {count}) g"
        ).format(
            table=sql.Identifier(spec.schema, table),
            published_at=sql.Identifier(spec.published_column),
            pad=sql.Literal(payload_bytes),
            published=sql.Literal(published),
            count=sql.Literal(count),
        )
    )
