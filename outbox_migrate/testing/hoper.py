"""Build the database state HOPER's copy-back starts from, directly with SQL.

For tests and benchmarks only. The pattern runner reaches this state through the catalog's
steps; copy-back tests and `bench/copy_back.py` need only the result: the old table attached
as the DEFAULT partition (identity dropped, primary key kept) and the former DEFAULT
partition detached, holding the rows published between V2 and V4.
"""

from __future__ import annotations

from typing import Any

from psycopg import Connection, sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import marker
from outbox_migrate.testing.schema import create_flat_outbox, create_partitioned_outbox, insert_rows


def build_after_v4(
    conn: Connection[Any],
    *,
    old_rows: int,
    published_rows: int,
    late_rows: int = 0,
    spec: OutboxSpec | None = None,
) -> OutboxSpec:
    """Old table with `old_rows`; `published_rows` in the detached source; `late_rows` rows
    inserted before V4 and published after it (they land in the old table directly)."""
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
