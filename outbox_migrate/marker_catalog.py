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

from outbox_migrate.config import OutboxSpec, Settings
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


@dataclass(frozen=True)
class Refusal:
    """Why a column cannot be the marker as configured: a `plan` blocker, or one line."""

    code: str
    message: str
    remedy: str

    def line(self) -> str:
        return f"{self.message}: {self.remedy}"


def decide(
    spec: OutboxSpec, column: MarkerColumn, table: str, *, to_partition: bool = True
) -> OutboxSpec | Refusal:
    """The spec with the marker's values filled in, or why the column cannot be a marker.
    `to_partition=False` (a relay or a reader of the flat table) accepts a nullable flag:
    only partitioning needs NOT NULL (a NULL row would land in the published partition)."""
    name = f"{table}.{spec.published_column}"
    if column.type in TIMESTAMP_TYPES:
        return _decide_timestamp(spec, column, name)
    if column.type.endswith("[]") or column.type.startswith(NOT_A_FLAG):
        return Refusal(
            "published-type",
            f"{name} is {column.type}, neither a timestamp nor a flag",
            "the partition key must be the nullable publication timestamp or a flag "
            "(smallint, integer, boolean, a text or enum status)",
        )
    return _decide_flag(spec, column, table, to_partition)


def _decide_timestamp(spec: OutboxSpec, column: MarkerColumn, name: str) -> OutboxSpec | Refusal:
    if spec.unpublished_value or spec.published_value:
        return Refusal(
            "published-value",
            f"{name} is a timestamp (NULL = unpublished, the relay sets now())",
            "unset unpublished_value and published_value",
        )
    if column.not_null:
        return Refusal(
            "published-not-null",
            f"{name} is NOT NULL",
            "unpublished rows need NULL there; this is not an outbox the patterns apply to",
        )
    return spec


def _decide_flag(
    spec: OutboxSpec, column: MarkerColumn, table: str, to_partition: bool
) -> OutboxSpec | Refusal:
    """A flag needs an unpublished value, NOT NULL (a NULL row would sit in the DEFAULT =
    published partition, never relayed) and a published value different from it."""
    name = f"{table}.{spec.published_column}"
    unpublished = _canonical(
        column.type, spec.unpublished_value or constant_default(column.default) or ""
    )
    if not unpublished:
        return Refusal(
            "published-flag-value",
            f"{name} is a {column.type} flag with no constant DEFAULT",
            "set unpublished_value to the value a new (unpublished) row has",
        )
    if to_partition and not (column.not_null or column.not_null_check):
        return Refusal(
            "published-flag-nullable",
            f"{name} is a nullable flag: a NULL row would land in the published (DEFAULT) "
            "partition and never be relayed",
            f"make it NOT NULL first (unpublished is {unpublished}): "
            + not_null_recipe(table, spec.published_column),
        )
    published = _canonical(
        column.type, spec.published_value or _obvious_published(column.type, unpublished)
    )
    if not published:
        return Refusal(
            "published-flag-value",
            f"{name} is a {column.type} flag (unpublished is {unpublished})",
            "set published_value to the value the relay sets on publish",
        )
    if published == unpublished:
        return Refusal(
            "published-flag-value",
            f"published_value and unpublished_value of {name} are both {published!r}",
            "the relay must set a value other than the unpublished one",
        )
    return replace(spec, unpublished_value=unpublished, published_value=published)


def not_null_recipe(table: str, column: str) -> str:
    """SET NOT NULL without holding ACCESS EXCLUSIVE through a scan: PostgreSQL 12+ proves it
    from a validated CHECK, and VALIDATE reads the table under SHARE UPDATE EXCLUSIVE."""
    check = f"{table}_{column}_not_null"
    return (
        f"ALTER TABLE {table} ADD CONSTRAINT {check} CHECK ({column} IS NOT NULL) NOT VALID; "
        f"ALTER TABLE {table} VALIDATE CONSTRAINT {check}; ALTER TABLE {table} ALTER COLUMN "
        f"{column} SET NOT NULL; ALTER TABLE {table} DROP CONSTRAINT {check}"
    )


def _canonical(column_type: str, value: str) -> str:
    """A boolean's or an integer's value as PostgreSQL prints it (`f`, `no`, `0` → `false`;
    `+01` → `1`), so the partition bound the catalog shows compares equal to the value."""
    if column_type in INTEGER_TYPES and re.fullmatch(r"\s*[-+]?\d+\s*", value):
        return str(int(value))
    if column_type != "boolean" or not value:
        return value
    lowered = value.strip().lower()
    if lowered in ("t", "true", "y", "yes", "on", "1"):
        return "true"
    if lowered in ("f", "false", "n", "no", "off", "0"):
        return "false"
    return value


def _obvious_published(column_type: str, unpublished: str) -> str:
    if column_type == "boolean":
        return {"false": "true", "true": "false"}.get(unpublished, "")
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
    values = [
        (spec.published_column, spec.unpublished_value, "unpublished_value"),
        (spec.published_column, spec.published_value, "published_value"),
        (spec.status_column, spec.status_published_value, "status_published_value"),
    ]
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


def resolve(conn: Connection[Any], spec: OutboxSpec, *, to_partition: bool = True) -> OutboxSpec:
    """The spec with its marker resolved against `spec.table`; raises `SchemaError` (one
    line) when the column cannot be a marker. A missing table or column is left to the
    callers' own checks (they name it better)."""
    found = read_column(conn, spec)
    if found is None:
        return spec
    relation, column = found
    table = spec.table if spec.schema == "public" else f"{spec.schema}.{spec.table}"
    if column.type in TIMESTAMP_TYPES:
        # A NOT NULL timestamp is plan's blocker, not ours: HOPER's optional set-not-null
        # step makes the old table's marker NOT NULL, and the runner must go on after it.
        column = replace(column, not_null=False)
    decided = decide(spec, column, table, to_partition=to_partition)
    if isinstance(decided, Refusal):
        raise SchemaError(decided.line())
    problem = check_values(conn, decided, relation, table)
    if problem:
        raise SchemaError(problem)
    return decided


def resolve_settings(dsn: str, settings: Settings) -> Settings:
    """`resolve` on a connection of its own, for a command that builds steps offline."""
    from outbox_migrate.db import connect

    with connect(dsn) as conn:
        return replace(settings, spec=resolve(conn, settings.spec))
