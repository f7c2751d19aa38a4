"""How copy-back carries ids: one code path for integer and application ids (uuid, ULID), as
text cast back to the id column's type. Composes SQL; runs only read-only queries, never DDL.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.jobs.common import Relation

IdValue = int | str
"""An id as copy-back reports it: an integer, or an application id as text."""


class CopyIds:
    """The id column of one copy-back's source, and how its values travel."""

    def __init__(self, conn: psycopg.Connection[Any], spec: OutboxSpec, source: Relation) -> None:
        self.conn = conn
        self.source = source
        self.name = spec.id_column
        self.column = sql.Identifier(spec.id_column)
        self.integer = spec.id_kind != "application"
        self._sql_type: sql.Composable | None = None

    def sql_type(self) -> sql.Composable:
        """The id's SQL type (from the catalog), to cast text bounds back to it."""
        if self._sql_type is None:
            row = self.conn.execute(
                "SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
                "WHERE a.attrelid = to_regclass(%s) AND a.attname = %s",
                (self.source.ident.as_string(self.conn), self.name),
            ).fetchone()
            fallback = "bigint" if self.integer else "text"
            self._sql_type = sql.SQL(str(row[0]) if row and row[0] else fallback)
        return self._sql_type

    def bound(self, name: str) -> sql.Composed:
        """A parameter compared with the id: text, cast to the id's type."""
        return sql.SQL("{}::{}").format(sql.Placeholder(name), self.sql_type())

    def out(self, alias: str = "") -> sql.Composed:
        """The id as selected: its text."""
        ident = sql.Identifier(alias, self.name) if alias else self.column
        return sql.SQL("{}::text").format(ident)

    def value(self, text: Any) -> IdValue | None:
        """An id's text as reported: an int for integer ids."""
        if text is None:
            return None
        return int(text) if self.integer else str(text)

    def text(self, value: IdValue | None) -> str | None:
        """A reported id back to the text the statements take."""
        return None if value is None else str(value)

    def integer_mark(self, expression: str) -> sql.Composable:
        """The bigint `high_water` column's value for a text mark (NULL for application ids):
        the column an operator or an older version reads."""
        if self.integer:
            return sql.SQL("{}::bigint").format(sql.Identifier(*expression.split(".")))
        return sql.SQL("NULL")

    def ends(self, conn: psycopg.Connection[Any]) -> tuple[int, str | None, str | None]:
        """The source's row count, lowest and highest id (as text), read on `conn`."""
        # Integer ids have min()/max(): one scan instead of three (uuid has neither).
        if self.integer:
            ends = sql.SQL("count(*), min({id})::text, max({id})::text").format(id=self.column)
        else:
            ends = sql.SQL(
                "count(*), (SELECT {out} FROM {s} ORDER BY {id} LIMIT 1), "
                "(SELECT {out} FROM {s} ORDER BY {id} DESC LIMIT 1)"
            ).format(out=self.out(), s=self.source.ident, id=self.column)
        row = conn.execute(sql.SQL("SELECT {} FROM {}").format(ends, self.source.ident)).fetchone()
        assert row is not None
        return int(row[0]), row[1], row[2]

    def range_end(self, low: str, width: int) -> str | None:
        """The exclusive upper bound of the verification range starting at `low`: `width` ids
        above it, or the id `width` rows on (None: the rest of the source)."""
        return str(int(low) + width) if self.integer else self.first_at_or_above(low, width)

    def first_at_or_above(self, low: str, skip: int = 0) -> str | None:
        """The lowest source id at or above `low` (ranges with no rows are skipped), or the
        one `skip` rows after it."""
        row = self.conn.execute(
            sql.SQL(
                "SELECT {out} FROM {s} WHERE {id} >= {low} ORDER BY {id} OFFSET %(skip)s LIMIT 1"
            ).format(out=self.out(), s=self.source.ident, id=self.column, low=self.bound("low")),
            {"low": low, "skip": skip},
        ).fetchone()
        return str(row[0]) if row else None
