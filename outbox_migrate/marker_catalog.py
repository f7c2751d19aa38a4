"""Resolve the spec's publication marker against the live column: a timestamp stays as it is
(NULL = unpublished); a flag gets its unpublished value from the settings, else from the
column's constant DEFAULT, and its published value from the settings, else `1`/`true`.

`decide` is pure (the judge and unit tests use it); `resolve` reads the column and asks the
server to read each value as the column's type, so a typo (`PENDNG` for an enum) is refused
here in one line instead of failing a step later. Nothing here writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from psycopg import Connection, sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import SchemaError

TIMESTAMP_TYPES = frozenset({"timestamp with time zone", "timestamp without time zone"})
INTEGER_TYPES = frozenset({"smallint", "integer", "bigint"})
NOT_A_FLAG = ("json", "jsonb", "bytea", "date", "time", "interval", "point", "tsvector")
"""Column types that cannot hold a flag or status a partition bound could name."""
_QUOTED = re.compile(r"^'((?:[^']|'')*)'(?:::[\w .\"]+)?$")
_NUMBER = re.compile(r"^\(?(-?\d+)\)?(?:::[\w ]+)?$")


@dataclass(frozen=True)
class MarkerColumn:
    """What the catalog says about the marker column."""

    type: str
    default: str | None
    not_null: bool
    not_null_check: bool = False
    """A validated CHECK (column IS NOT NULL) stands in for NOT NULL."""


def constant_default(default: str | None) -> str | None:
    """The value of a constant DEFAULT as `pg_get_expr` shows it (`0`, `false`,
    `'PENDING'::text`, `'NEW'::status`), else None (no default, or an expression)."""
    if default is None:
        return None
    text = default.strip()
    if text in ("true", "false"):
        return text
    number = _NUMBER.match(text)
    if number:
        return number.group(1)
    quoted = _QUOTED.match(text)
    if quoted:
        return quoted.group(1).replace("''", "'")
    return None


def decide(spec: OutboxSpec, column: MarkerColumn, table: str) -> OutboxSpec | str:
    """The spec with the marker's values filled in, or why the column cannot be a marker
    (one line with what to set or run)."""
    name = f"{table}.{spec.published_column}"
    if column.type in TIMESTAMP_TYPES:
        if spec.unpublished_value or spec.published_value:
            return (
                f"{name} is a timestamp (NULL = unpublished, the relay sets now()); "
                "unset unpublished_value and published_value"
            )
        if column.not_null:
            return (
                f"{name} is NOT NULL: unpublished rows need NULL in a timestamp marker; "
                "this is not an outbox the patterns apply to"
            )
        return spec
    if column.type.endswith("[]") or column.type.startswith(NOT_A_FLAG):
        return (
            f"{name} is {column.type}: the publication marker must be a nullable timestamp "
            "or a flag (smallint, integer, boolean, a text or enum status)"
        )
    unpublished = spec.unpublished_value or constant_default(column.default) or ""
    if not unpublished:
        return (
            f"{name} is {column.type} with no constant DEFAULT: set unpublished_value to the "
            "value a new (unpublished) row has"
        )
    if not (column.not_null or column.not_null_check):
        return (
            f"{name} is a nullable flag: a NULL row would land in the published partition "
            f"and never be relayed; make it NOT NULL first ({spec.published_column} = "
            f"{unpublished} is unpublished)"
        )
    published = spec.published_value or _obvious_published(column.type, unpublished)
    if not published:
        return (
            f"{name} is {column.type}: set published_value to the value the relay sets on "
            f"publish (unpublished is {unpublished})"
        )
    if published == unpublished:
        return f"published_value and unpublished_value of {name} are both {published!r}"
    return replace(spec, unpublished_value=unpublished, published_value=published)


def _obvious_published(column_type: str, unpublished: str) -> str:
    if column_type == "boolean":
        return {"false": "true", "f": "true", "true": "false", "t": "false"}.get(
            unpublished.lower(), ""
        )
    if column_type in INTEGER_TYPES and unpublished == "0":
        return "1"
    return ""


def read_column(conn: Connection[Any], spec: OutboxSpec) -> tuple[str, MarkerColumn] | None:
    """The marker column's type, DEFAULT and nullability, on the old table or, once that is
    gone (a finished migration), on the partitioned one; None when neither has the column
    (introspection reports that)."""
    for relation in (spec.table, spec.partitioned_table):
        found = _read_column(conn, spec, relation)
        if found is not None:
            return relation, found
    return None


def _read_column(conn: Connection[Any], spec: OutboxSpec, relation: str) -> MarkerColumn | None:
    row = conn.execute(
        "SELECT format_type(a.atttypid, a.atttypmod), pg_get_expr(d.adbin, d.adrelid), "
        "a.attnotnull, EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conrelid = a.attrelid "
        "AND c.contype = 'c' AND c.convalidated AND pg_get_constraintdef(c.oid) = "
        "format('CHECK ((%%I IS NOT NULL))', a.attname)) "
        "FROM pg_attribute a LEFT JOIN pg_attrdef d "
        "ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
        "WHERE a.attrelid = to_regclass(%s) AND a.attname = %s AND NOT a.attisdropped",
        (sql.Identifier(spec.schema, relation).as_string(None), spec.published_column),
    ).fetchone()
    if row is None:
        return None
    return MarkerColumn(str(row[0]), row[1], bool(row[2]), bool(row[3]))


def check_values(conn: Connection[Any], spec: OutboxSpec, relation: str, table: str) -> str:
    """ "" when the server reads every configured value as the column's type, else why not.
    Parsing alone decides (`LIMIT 0` reads no row); a savepoint keeps a caller's
    transaction usable after a refusal."""
    values = [(spec.published_column, spec.unpublished_value, "unpublished_value"),
              (spec.published_column, spec.published_value, "published_value"),
              (spec.status_column, spec.status_published_value, "status_published_value")]  # fmt: skip
    for column, value, key in values:
        if not column or not value:
            continue
        probe = sql.SQL("SELECT {c} = {v} FROM {t} LIMIT 0").format(
            c=sql.Identifier(column),
            v=sql.Literal(value),
            t=sql.Identifier(spec.schema, relation),
        )
        try:
            with conn.transaction():
                conn.execute(probe)
        except psycopg.errors.DataError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return f"{key} {value!r} is not a value of {table}.{column}: {first}"
        except psycopg.errors.UndefinedColumn:
            return f"{table} has no column {column!r} (status_column)"
    return ""


def resolve(conn: Connection[Any], spec: OutboxSpec) -> OutboxSpec:
    """The spec with its marker resolved against `spec.table`; raises `SchemaError` (one
    line) when the column cannot be a marker. A missing table or column is left to the
    callers' own checks (they name it better)."""
    found = read_column(conn, spec)
    if found is None:
        return spec
    relation, column = found
    table = spec.table if spec.schema == "public" else f"{spec.schema}.{spec.table}"
    decided = decide(spec, column, table)
    if isinstance(decided, str):
        raise SchemaError(decided)
    problem = check_values(conn, decided, relation, table)
    if problem:
        raise SchemaError(problem)
    return decided
