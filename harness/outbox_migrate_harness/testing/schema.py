"""Reference outbox schemas for tests, benchmarks and the simulator: the spec's flat outbox
(plus `event_type` and `message_key`), its partitioned target built directly, and the state
HOPER's copy-back starts from (`build_after_v4`)."""

from __future__ import annotations

from typing import Any

from psycopg import Connection, sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import marker


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
    statements = sql.SQL(
        "CREATE SCHEMA IF NOT EXISTS {schema}; "
        "CREATE TABLE {table} (" + COLUMNS + ", PRIMARY KEY ({id})); "
        "CREATE INDEX {flat_index} ON {table} ({id}) WHERE {published_at} IS NULL"
    )
    conn.execute(statements.format(identity_options=sql.SQL(""), **_names(spec or OutboxSpec())))


def create_partitioned_outbox(
    conn: Connection[Any], spec: OutboxSpec | None = None, *, start: int = 1
) -> None:
    """The revamped outbox: LIST (published_at), NULL partition + DEFAULT partition."""
    statements = sql.SQL(
        "CREATE SCHEMA IF NOT EXISTS {schema}; "
        "CREATE TABLE {parent} (" + COLUMNS + ") PARTITION BY LIST ({published_at}); "
        "CREATE TABLE {unpublished} PARTITION OF {parent} FOR VALUES IN (NULL); "
        "CREATE TABLE {published} PARTITION OF {parent} DEFAULT; "
        "CREATE INDEX {unpublished_index} ON {unpublished} ({id})"
    )
    identity_options = sql.SQL(" (START {})").format(sql.Literal(start))
    conn.execute(
        statements.format(identity_options=identity_options, **_names(spec or OutboxSpec()))
    )


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


def build_after_v4(
    conn: Connection[Any],
    *,
    old_rows: int,
    published_rows: int,
    late_rows: int = 0,
    spec: OutboxSpec | None = None,
) -> OutboxSpec:
    """The state HOPER's copy-back starts from, for copy-back tests and `bench/copy_back.py`
    (the runner reaches it through the catalog's steps): the old table, with `old_rows`,
    attached as the DEFAULT partition (identity dropped, primary key kept), and the former
    DEFAULT partition detached, holding the `published_rows` published between V2 and V4.
    `late_rows` rows are inserted before V4 and published after it (they land in the old
    table directly)."""
    spec = spec or OutboxSpec()
    ident = sql.Identifier
    table = ident(spec.schema, spec.table)
    parent = ident(spec.schema, spec.partitioned_table)
    published = ident(spec.schema, spec.published_partition)
    id_col = ident(spec.id_column)
    create_flat_outbox(conn, spec)
    insert_rows(conn, spec.table, old_rows, spec=spec, published=True)
    row = conn.execute(sql.SQL("SELECT coalesce(max({}), 0) FROM {}").format(id_col, table))
    start = int(row.fetchone()[0]) + spec.id_headroom  # type: ignore[index]
    create_partitioned_outbox(conn, spec, start=start)
    # Interleave: late rows get ids between the published ones, as in production.
    insert_rows(conn, spec.partitioned_table, published_rows + late_rows, spec=spec)
    # Publish all but `late_rows` rows spread evenly over the id range.
    every = max(1, (published_rows + late_rows) // max(late_rows, 1))
    conn.execute(
        sql.SQL(
            "UPDATE {p} SET {mark} WHERE {unpublished} AND {id} NOT IN ("
            " SELECT {id} FROM (SELECT {id}, row_number() OVER (ORDER BY {id}) AS rn FROM {p}) x"
            " WHERE rn % {every} = 0 ORDER BY {id} LIMIT {late})"
        ).format(
            p=parent, mark=marker.mark(spec), unpublished=marker.unpublished(spec), id=id_col,
            every=sql.Literal(every),
            late=sql.Literal(late_rows),
        )
    )  # fmt: skip
    # V4, as the spec writes it: drop identity, NOT VALID check, validate, swap, drop check.
    check = ident(spec.check_name)
    conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP IDENTITY").format(table, id_col))
    conn.execute(
        sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} CHECK ({}) NOT VALID").format(
            table, check, marker.published(spec)
        )
    )
    conn.execute(sql.SQL("ALTER TABLE {} VALIDATE CONSTRAINT {}").format(table, check))
    with conn.transaction():
        conn.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(parent, published))
        conn.execute(sql.SQL("ALTER TABLE {} ATTACH PARTITION {} DEFAULT").format(parent, table))
    conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(table, check))
    # Late rows are published after V4: they move into the old table, now the DEFAULT.
    conn.execute(
        sql.SQL("UPDATE {p} SET {mark} WHERE {unpublished}").format(
            p=parent, mark=marker.mark(spec), unpublished=marker.unpublished(spec)
        )
    )
    return spec
