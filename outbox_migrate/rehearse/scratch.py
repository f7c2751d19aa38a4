"""The scratch copy: the live outbox's schema rebuilt in another database, and rows to fill it;
what cannot be carried is listed (`Rebuilt.skipped`). Types, defaults and definitions are SQL
PostgreSQL itself rendered, used as SQL text; every name we compose is quoted with `psycopg.sql`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.advisory.introspect import ColumnFact
from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import OutboxMigrateError
from outbox_migrate.patterns import marker, marker_catalog
from outbox_migrate.rehearse.source import SourceShape

UNPUBLISHED_ROWS_MAX = 500
"""Unpublished rows the copy starts with at most: a backlog the relays publish at start."""
ROW_OVERHEAD_BYTES = 120
"""What a synthetic row weighs besides its padding (ids, timestamps, tuple header): the
padding makes the copy's average row as wide as the source's."""

_TEXT = {"text", "character varying", "character", "name", "citext"}
_INTEGER = {"smallint", "integer", "bigint"}


class ScratchError(OutboxMigrateError):
    """The source's shape cannot be rebuilt or filled in the scratch database."""


@dataclass
class Rebuilt:
    rows: int = 0
    skipped: list[str] = field(default_factory=list)
    heap_bytes: int = 0
    scan_s: float = 0.0
    """The filled copy's heap and the seconds of its fastest full scan (`rehearse` measures)."""


def _base(type_sql: str) -> str:
    """`character varying(200)` → `character varying`, `numeric(10,2)` → `numeric`."""
    return type_sql.split("(", maxsplit=1)[0].strip().removesuffix("[]")


_VALUE_BY_TYPE: dict[str, str] = {
    **dict.fromkeys(_TEXT, "('v' || ({n}))::{t}"),
    **dict.fromkeys(("json", "jsonb"), "json_build_object('n', {n})::{t}"),
    "bytea": "convert_to(({n})::text, 'UTF8')",
    **dict.fromkeys((*_INTEGER, "numeric", "real", "double precision"), "(({n}) % 32000)::{t}"),
    "uuid": "md5(({n})::text || clock_timestamp()::text)::uuid",
    **dict.fromkeys(
        ("timestamp with time zone", "timestamp without time zone", "date"), "now()::{t}"
    ),
    "boolean": "false",
}
"""A made-up value per base type, as SQL over `{n}` (an integer expression) cast to `{t}`."""


def value_sql(
    column: ColumnFact, shape: SourceShape, spec: OutboxSpec, *, n: str, pad_bytes: int
) -> sql.Composable | None:
    """A synthetic value for `column`, as SQL over the integer expression `n`; None when the
    type is unknown to us (the column then gets its default, or NULL). Key values are unique
    (the report matches deliveries by key: a repeated key would count as a duplicate); the
    payload is padded to the source's average row width."""
    base = _base(column.type)
    parts: dict[str, sql.Composable] = {"n": sql.SQL(n), "t": sql.SQL(column.type)}
    template = _VALUE_BY_TYPE.get(base)
    labels = shape.enums.get(column.type)
    if column.type.endswith("[]"):
        template = None
    elif column.name == spec.key_column and base in _TEXT:
        template = "('prefill-' || ({n}))::{t}"
    elif column.name == spec.payload_column:
        parts["pad"] = sql.Literal("x" * max(pad_bytes, 0))
        body = "json_build_object('n', {n}, 'pad', {pad})::text"
        template = f"convert_to({body}, 'UTF8')" if base == "bytea" else f"({body})::{{t}}"
    elif template is None and labels:
        parts["label"] = sql.Literal(labels[0])
        template = "{label}::{t}"
    return None if template is None else sql.SQL(template).format(**parts)


def insert_statement(shape: SourceShape, spec: OutboxSpec) -> tuple[str, str]:
    """The rehearsal application's INSERT (see `Scenario.insert_sql`) and its identity mode.

    A text key column carries the writer's unique key ("key" identity); without one the
    INSERT returns the id, and deliveries are matched by id."""
    key = shape.facts.column(spec.key_column)
    by_key = key is not None and _base(key.type) in _TEXT
    own = {spec.key_column: sql.SQL(_KEY_SENTINEL)} if by_key else {}
    names, values = _made_up(shape, spec, "(random() * 1000000)::int", own)
    returning = sql.SQL("" if by_key else " RETURNING {}").format(sql.Identifier(spec.id_column))
    statement = sql.SQL("INSERT INTO {} ({}) VALUES ({}){}").format(
        sql.Identifier(_TABLE_SENTINEL),
        sql.SQL(", ").join(names),
        sql.SQL(", ").join(values),
        returning,
    )
    # The text is formatted twice more (the table by `str.format`-like composition, the key
    # as a query parameter): escape what either would read, then put the two placeholders in.
    text = statement.as_string(None).replace("%", "%%").replace("{", "{{").replace("}", "}}")
    text = text.replace(f'"{_TABLE_SENTINEL}"', "{table}").replace(_KEY_SENTINEL, "%(key)s")
    return text, "key" if by_key else "id"


_TABLE_SENTINEL = "rehearsal_table_placeholder"
_KEY_SENTINEL = "rehearsal_key_placeholder"


def _made_up(
    shape: SourceShape, spec: OutboxSpec, n: str, own: Mapping[str, sql.Composable]
) -> tuple[list[sql.Composable], list[sql.Composable]]:
    """The columns a synthetic row sets and their made-up values (`n`: the row's number),
    `own` taking precedence; a NOT NULL column of a type with no made-up value is refused.

    Not set: generated, identity and defaulted columns (the database fills those as the
    application's INSERT would let it), and the publication marker."""
    names: list[sql.Composable] = []
    values: list[sql.Composable] = []
    facts = shape.facts
    known = facts.row_estimate > 0 and facts.heap_bytes > 0
    pad_bytes = (
        min(facts.heap_bytes // facts.row_estimate - ROW_OVERHEAD_BYTES, 8_000) if known else 0
    )
    for column in facts.columns:
        if column.generated or column.identity or column.default is not None:
            continue
        if column.name == spec.published_column:
            continue
        value = own.get(column.name) or value_sql(column, shape, spec, n=n, pad_bytes=pad_bytes)
        if value is None:
            if column.not_null:
                raise ScratchError(
                    f"cannot make up values of type {column.type} for NOT NULL column "
                    f"{column.name!r} of {spec.table}; rehearse --sample copies real rows"
                )
            continue
        names.append(sql.Identifier(column.name))
        values.append(value)
    return names, values


def rebuild(conn: psycopg.Connection[Any], shape: SourceShape, spec: OutboxSpec) -> Rebuilt:
    """Create the table with its types, sequences, constraints, indexes, triggers and grants;
    an object that may fail gets a savepoint, so one the scratch server cannot take is skipped
    and reported while the rest is built."""
    facts = shape.facts
    done = Rebuilt()
    table = sql.Identifier(spec.schema, spec.table)
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(spec.schema)))
    # Enum and sequence names are `schema.name` as the catalog printed them (quoted already).
    for name in [*shape.enums, *shape.sequences]:
        if "." in name and not name.startswith('"'):
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.SQL(name.split(".")[0]))
            )
    for name, labels in shape.enums.items():
        conn.execute(
            sql.SQL("CREATE TYPE {} AS ENUM ({})").format(
                sql.SQL(name), sql.SQL(", ").join(map(sql.Literal, labels))
            )
        )
    for sequence in shape.sequences:
        conn.execute(sql.SQL("CREATE SEQUENCE {}").format(sql.SQL(sequence)))
    conn.execute(sql.SQL("CREATE TABLE {} ({})").format(table, _column_list(facts.columns)))
    if facts.sequence_owned and facts.sequence in shape.sequences:
        conn.execute(
            sql.SQL("ALTER SEQUENCE {} OWNED BY {}").format(
                sql.SQL(facts.sequence), sql.Identifier(spec.schema, spec.table, spec.id_column)
            )
        )
    constraint_names = set()
    for name, definition, validated in facts.constraints:
        if definition.startswith("FOREIGN KEY"):
            done.skipped.append(f"foreign key {name} (its target is not copied)")
            continue
        constraint_names.add(name)
        suffix = "" if validated else " NOT VALID"
        conn.execute(
            sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}{}").format(
                table, sql.Identifier(name), sql.SQL(definition), sql.SQL(suffix)
            )
        )
    for name, definition, *_ in facts.index_details:
        if name not in constraint_names:
            conn.execute(sql.SQL(definition))
    for text in shape.trigger_functions:
        _try(conn, sql.SQL(text), done, "trigger function")
    for name, definition, enabled in facts.trigger_details:
        if _try(conn, sql.SQL(definition), done, f"trigger {name}") and enabled == "D":
            conn.execute(
                sql.SQL("ALTER TABLE {} DISABLE TRIGGER {}").format(table, sql.Identifier(name))
            )
    _grant(conn, shape, table, done)
    return done


def _column_list(columns: Iterable[ColumnFact]) -> sql.Composable:
    parts: list[sql.Composable] = []
    for c in columns:
        piece: list[sql.Composable] = [sql.Identifier(c.name), sql.SQL(c.type)]
        if c.collation and c.collation != "default":
            piece.append(sql.SQL("COLLATE {}").format(sql.Identifier(c.collation)))
        if c.identity:
            how = "ALWAYS" if c.identity == "a" else "BY DEFAULT"
            piece.append(sql.SQL(f"GENERATED {how} AS IDENTITY"))
        elif c.generated and c.default is not None:
            piece.append(sql.SQL("GENERATED ALWAYS AS ({}) STORED").format(sql.SQL(c.default)))
        elif c.default is not None:
            piece.append(sql.SQL("DEFAULT {}").format(sql.SQL(c.default)))
        if c.not_null:
            piece.append(sql.SQL("NOT NULL"))
        parts.append(sql.SQL(" ").join(piece))
    return sql.SQL(", ").join(parts)


def _try(
    conn: psycopg.Connection[Any], statement: sql.SQL | sql.Composed, done: Rebuilt, what: str
) -> bool:
    try:
        with conn.transaction():
            conn.execute(statement)
    except psycopg.Error as exc:
        done.skipped.append(f"{what}: {str(exc).splitlines()[0]}")
        return False
    return True


def _grant(
    conn: psycopg.Connection[Any], shape: SourceShape, table: sql.Composable, done: Rebuilt
) -> None:
    """The source's grants, to roles of the same names (created NOLOGIN where missing: on a
    scratch server of our own that is harmless, and the migration's grant handling is then
    rehearsed too)."""
    for grantee, privilege in shape.grants:
        role = sql.SQL("PUBLIC") if grantee == "PUBLIC" else sql.Identifier(grantee)
        if grantee != "PUBLIC":
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (grantee,))
            if exists.fetchone() is None and not _try(
                conn, sql.SQL("CREATE ROLE {} NOLOGIN").format(role), done, f"role {grantee}"
            ):
                continue
        _try(
            conn,
            sql.SQL("GRANT {} ON {} TO {}").format(sql.SQL(privilege), table, role),
            done,
            f"grant {privilege} to {grantee}",
        )


def fill_synthetic(
    conn: psycopg.Connection[Any], shape: SourceShape, spec: OutboxSpec, rows: int
) -> int:
    """`rows` made-up rows of the source's shape and average width: all published but for a
    backlog shaped like the source's (at most `UNPUBLISHED_ROWS_MAX`)."""
    facts = shape.facts
    share = facts.unpublished / facts.row_estimate if facts.row_estimate > 0 else 0.0
    unpublished = min(UNPUBLISHED_ROWS_MAX, round(rows * share), facts.unpublished)
    flag = marker.of(marker_catalog.resolve(conn, spec))
    # The newest `unpublished` rows are the backlog; the others published, oldest first.
    published: sql.Composable = sql.SQL("now() - ({} - g) * interval '1 ms'").format(
        sql.Literal(rows)
    )
    marker_column = facts.column(spec.published_column)
    if flag.is_flag and marker_column is not None:
        # In a CASE an untyped literal would be text: cast to the column type (as value_sql).
        kind = sql.SQL(marker_column.type)
        published = sql.SQL("{}::{t} ELSE {}::{t}").format(
            sql.Literal(flag.published_value), sql.Literal(flag.unpublished_value), t=kind
        )
    names, values = _made_up(shape, spec, "g", {})
    names.insert(0, sql.Identifier(spec.published_column))
    cutoff = sql.Literal(rows - unpublished)
    values.insert(0, sql.SQL("CASE WHEN g <= {} THEN {} END").format(cutoff, published))
    conn.execute(
        sql.SQL("INSERT INTO {} ({}) SELECT {} FROM generate_series(1, {}) AS g").format(
            sql.Identifier(spec.schema, spec.table),
            sql.SQL(", ").join(names),
            sql.SQL(", ").join(values),
            sql.Literal(rows),
        )
    )
    conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(spec.schema, spec.table)))
    return rows


def fill_sample(
    source: psycopg.Connection[Any],
    conn: psycopg.Connection[Any],
    shape: SourceShape,
    spec: OutboxSpec,
    rows: int,
) -> int:
    """The newest `rows` real rows, copied with COPY (the source session is read-only).

    Real payloads leave the source this way: opt-in only (`--sample`)."""
    columns = [c for c in shape.facts.columns if not c.generated]
    names = sql.SQL(", ").join(sql.Identifier(c.name) for c in columns)
    table = sql.Identifier(spec.schema, spec.table)
    copied = 0
    read = sql.SQL("COPY (SELECT {} FROM {} ORDER BY {} DESC LIMIT {}) TO STDOUT").format(
        names, table, sql.Identifier(spec.id_column), sql.Literal(rows)
    )
    with (
        source.cursor() as src,
        src.copy(read) as out,
        conn.cursor() as dst,
        dst.copy(sql.SQL("COPY {} ({}) FROM STDIN").format(table, names)) as into,
    ):
        for data in out:
            into.write(data)
            copied += bytes(data).count(b"\n")
    if any(c.name == spec.id_column and (c.identity or c.default) for c in columns):
        conn.execute(
            sql.SQL(
                "SELECT setval(pg_get_serial_sequence({t}, {c}), max({i})) FROM {r} "
                "HAVING max({i}) IS NOT NULL"
            ).format(
                t=sql.Literal(table.as_string(conn)),
                c=sql.Literal(spec.id_column),
                i=sql.Identifier(spec.id_column),
                r=table,
            )
        )
    conn.execute(sql.SQL("ANALYZE {}").format(table))
    return copied
