"""The unique key a mark broke, when it is a key on the id alone: which rows it holds already.

After the swap a row whose id the published partition's key holds cannot move there. The
error names the index in every language (its detail names only the first row, in English), so
the relay asks which of a batch's ids the table holds, all at once, rather than bisect
(relay/mark_repair.py). Any other key or constraint, or one on a table the role may not read,
has no `ConflictKey`: the repair bisects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.relay.message import MessageId

_KEY_COLUMN = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod)
FROM pg_index i
JOIN pg_class ic ON ic.oid = i.indexrelid
JOIN pg_class tc ON tc.oid = i.indrelid
JOIN pg_namespace n ON n.oid = tc.relnamespace
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
WHERE n.nspname = %s AND tc.relname = %s AND ic.relname = %s AND ic.relnamespace = n.oid
  AND i.indisunique AND i.indnkeyatts = 1 AND i.indexprs IS NULL AND i.indpred IS NULL
  AND has_table_privilege(tc.oid, 'SELECT')
"""


@dataclass(frozen=True)
class ConflictKey:
    """A unique index on one column of the table a mark moves rows into."""

    schema: str
    table: str
    index: str
    column: str
    type_sql: str

    def lookup(self, ids: list[MessageId], text_ids: bool) -> sql.Composed:
        """The ids the table holds, through its index whatever the statistics say (a
        partition analyzed when small would be seq-scanned); rows in the second result."""
        column = sql.Identifier(self.column)
        return sql.SQL(
            "SET LOCAL enable_seqscan = off; "
            "SELECT {out} FROM {table} WHERE {column} = ANY({ids}::{type}[]); "
            "SET LOCAL enable_seqscan = on"
        ).format(
            out=sql.SQL("{}::text").format(column) if text_ids else column,
            table=sql.Identifier(self.schema, self.table),
            column=column,
            # A hand-made literal: adapting a list of ints costs more than the lookup.
            ids=sql.Literal([str(i) for i in ids] if text_ids else _int_array(ids)),
            type=sql.SQL(self.type_sql),
        )

    def taken(self, conn: Any, ids: list[MessageId], text_ids: bool) -> set[MessageId]:
        """Those of `ids` the table holds already (in the caller's transaction)."""
        if not ids:
            return set()
        return taken_rows(conn.execute(self.lookup(ids, text_ids)))

    def reason(self, ident: MessageId) -> str:
        """The server's words for a taken id, for the dead letter."""
        return (
            f'SQLSTATE 23505: duplicate key value violates unique constraint "{self.index}" '
            f"(Key ({self.column})=({ident}) already exists in {self.schema}.{self.table}.)"
        )


def of_error(conn: Any, error: psycopg.Error | None, id_column: str) -> ConflictKey | None:
    """The key a unique violation names, when it is a unique index on `id_column` alone."""
    if error is None or error.sqlstate != "23505":
        return None
    diag = error.diag
    schema, table, index = diag.schema_name, diag.table_name, diag.constraint_name
    if not (schema and table and index):
        return None
    row = conn.execute(_KEY_COLUMN, (schema, table, index)).fetchone()
    if row is None or row[0] != id_column:
        return None
    return ConflictKey(schema, table, index, row[0], row[1])


def taken_rows(cursor: Any) -> set[MessageId]:
    """The ids a `lookup` found: the next result with rows after the cursor's."""
    cursor.nextset()
    while cursor.description is None:
        if not cursor.nextset():
            raise RuntimeError("a conflict-key lookup returned no rows result")  # a bug
    return {r[0] for r in cursor.fetchall()}


def _int_array(ids: list[MessageId]) -> str:
    return "{" + ",".join(str(int(i)) for i in ids) + "}"
