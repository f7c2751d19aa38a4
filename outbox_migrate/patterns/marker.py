"""The publication marker, rendered: the one place that knows what "unpublished", "published"
and "mark it published" mean in SQL, for a timestamp (NULL = unpublished) or a flag marker.
Pure; `marker_catalog.py` resolves a spec against the catalog.

Values are untyped `sql.Literal`s: next to the column an untyped literal takes the column's own
type, enum included, without us composing a type name.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from outbox_migrate.config import OutboxSpec

NULL_BOUND = "FOR VALUES IN (NULL)"
"""The unpublished partition's bound as steps name it; a flag's value replaces NULL."""


@dataclass(frozen=True)
class Marker:
    """What marks a row published, from the spec's settings."""

    column: str
    unpublished_value: str
    """"" for a timestamp marker (NULL = unpublished), else the flag's unpublished value."""
    published_value: str
    """What the relay sets: "" = `now()` (a timestamp), else the flag's published value."""
    status_column: str = ""
    """A status column the relay's mark sets too (Spring Modulith's `status`), "" if none."""
    status_published_value: str = ""

    @property
    def is_flag(self) -> bool:
        return self.unpublished_value != ""


def of(spec: OutboxSpec) -> Marker:
    return Marker(
        column=spec.published_column,
        unpublished_value=spec.unpublished_value,
        published_value=spec.published_value,
        status_column=spec.status_column,
        status_published_value=spec.status_published_value,
    )


def _column(marker: Marker, alias: str) -> sql.Identifier:
    return sql.Identifier(alias, marker.column) if alias else sql.Identifier(marker.column)


def unpublished(spec: OutboxSpec | Marker, alias: str = "") -> sql.Composed:
    """The rows still to publish: `published_at IS NULL`, or `published = '0'`."""
    marker = spec if isinstance(spec, Marker) else of(spec)
    column = _column(marker, alias)
    if marker.is_flag:
        return sql.SQL("{} = {}").format(column, sql.Literal(marker.unpublished_value))
    return sql.SQL("{} IS NULL").format(column)


def published(spec: OutboxSpec | Marker, alias: str = "") -> sql.Composed:
    """The rows the DEFAULT partition may hold, as a CHECK that implies its partition
    constraint `NOT (m IS NOT NULL AND m = v)`: `m IS NOT NULL` for a timestamp, `m IS NOT
    NULL AND m <> v` for a flag (a NULL flag would otherwise land in the DEFAULT partition)."""
    marker = spec if isinstance(spec, Marker) else of(spec)
    column = _column(marker, alias)
    if marker.is_flag:
        return sql.SQL("{c} IS NOT NULL AND {c} <> {v}").format(
            c=column, v=sql.Literal(marker.unpublished_value)
        )
    return sql.SQL("{} IS NOT NULL").format(column)


def mark(spec: OutboxSpec | Marker) -> sql.Composed:
    """The SET list of the relay's mark: `published_at = now()` or `published = '1'`, and
    the status column beside it when one is configured."""
    marker = spec if isinstance(spec, Marker) else of(spec)
    value: sql.Composable = (
        sql.Literal(marker.published_value) if marker.is_flag else sql.SQL("now()")
    )
    parts = [sql.SQL("{} = {}").format(sql.Identifier(marker.column), value)]
    if marker.status_column:
        parts.append(
            sql.SQL("{} = {}").format(
                sql.Identifier(marker.status_column), sql.Literal(marker.status_published_value)
            )
        )
    return sql.SQL(", ").join(parts)


def bound(spec: OutboxSpec | Marker) -> sql.Composed:
    """The unpublished partition's bound: `FOR VALUES IN (NULL)` or `FOR VALUES IN ('0')`."""
    marker = spec if isinstance(spec, Marker) else of(spec)
    value = sql.Literal(marker.unpublished_value) if marker.is_flag else sql.SQL("NULL")
    return sql.SQL("FOR VALUES IN ({})").format(value)


def bound_text(spec: OutboxSpec) -> str:
    """The unpublished partition's bound as text (`pg_get_expr` shows `'0'` or `false` for a
    flag depending on the column's type: compare it without quotes)."""
    marker = of(spec)
    if not marker.is_flag:
        return NULL_BOUND
    return f"FOR VALUES IN ({marker.unpublished_value})"


def describe_unpublished(spec: OutboxSpec) -> str:
    """For summaries and messages: `published_at IS NULL` or `published = 0`."""
    marker = of(spec)
    if marker.is_flag:
        return f"{marker.column} = {marker.unpublished_value}"
    return f"{marker.column} IS NULL"


def describe_published(spec: OutboxSpec) -> str:
    marker = of(spec)
    if marker.is_flag:
        return f"{marker.column} IS NOT NULL AND {marker.column} <> {marker.unpublished_value}"
    return f"{marker.column} IS NOT NULL"
