"""Resolve the spec's publication marker against the live column, and infer it from the
evidence when the spec left it at its default name. `decide` is pure; `resolve` also asks the
server to read each configured value as the column's type, so a typo is refused here in one
line instead of failing a step later. Nothing here writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from psycopg import Connection, sql

from outbox_migrate.config import OutboxSpec, Settings
from outbox_migrate.errors import SchemaError
from outbox_migrate.patterns.names import Names, ident

TIMESTAMP_TYPES = frozenset({"timestamp with time zone", "timestamp without time zone"})
INTEGER_TYPES = frozenset({"smallint", "integer", "bigint"})
NOT_A_FLAG = ("json", "jsonb", "bytea", "date", "time", "interval", "point", "tsvector")
"""Column types that cannot hold a flag or status a partition bound could name."""
_QUOTED = re.compile(r"^'((?:[^']|'')*)'(?:::[\w .\"]+)?$")
_NUMBER = re.compile(r"^\(?(-?\d+)\)?(?:::[\w ]+)?$")


@dataclass(frozen=True)
class MarkerColumn:
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
class Finding:
    """A blocker or warning: what was found and what to do. Here, why a column cannot be the
    marker as configured: a `plan` blocker, or one line; the advisory layer's vocabulary."""

    code: str
    message: str
    remedy: str
    fix_sql: str = ""
    """The SQL the remedy prints, verbatim (the tests run it against the table it names):
    empty when the fix is a setting or a decision, not a statement."""

    def line(self) -> str:
        return f"{self.message}: {self.remedy}"


def decide(
    spec: OutboxSpec, column: MarkerColumn, table: str, *, to_partition: bool = True
) -> OutboxSpec | Finding:
    """The spec with the marker's values filled in, or why the column cannot be a marker.
    `to_partition=False` (a relay or a reader of the flat table) accepts a nullable flag:
    only partitioning needs NOT NULL (a NULL row would land in the published partition)."""
    name = f"{table}.{spec.published_column}"
    if column.type in TIMESTAMP_TYPES:
        return _decide_timestamp(spec, column, name)
    if column.type.endswith("[]") or column.type.startswith(NOT_A_FLAG):
        return Finding(
            "published-type",
            f"{name} is {column.type}, neither a timestamp nor a flag",
            "the partition key must be the nullable publication timestamp or a flag "
            "(smallint, integer, boolean, a text or enum status)",
        )
    return _decide_flag(spec, column, table, to_partition)


def _decide_timestamp(spec: OutboxSpec, column: MarkerColumn, name: str) -> OutboxSpec | Finding:
    if spec.unpublished_value or spec.published_value:
        return Finding(
            "published-value",
            f"{name} is a timestamp (NULL = unpublished, the relay sets now())",
            "unset unpublished_value and published_value",
        )
    if column.not_null:
        return Finding(
            "published-not-null",
            f"{name} is NOT NULL",
            "unpublished rows need NULL there; this is not an outbox the patterns apply to",
        )
    return spec


def _decide_flag(
    spec: OutboxSpec, column: MarkerColumn, table: str, to_partition: bool
) -> OutboxSpec | Finding:
    """A flag needs an unpublished value, NOT NULL (a NULL row would sit in the DEFAULT =
    published partition, never relayed) and a published value different from it."""
    name = f"{table}.{spec.published_column}"
    unpublished = _canonical(
        column.type, spec.unpublished_value or constant_default(column.default) or ""
    )
    if not unpublished:
        return Finding(
            "published-flag-value",
            f"{name} is a {column.type} flag with no constant DEFAULT",
            "set unpublished_value to the value a new (unpublished) row has",
        )
    if to_partition and not (column.not_null or column.not_null_check):
        recipe = not_null_recipe(spec.schema, spec.table, spec.published_column)
        return Finding(
            "published-flag-nullable",
            f"{name} is a nullable flag: a NULL row would land in the published (DEFAULT) "
            "partition and never be relayed",
            f"make it NOT NULL first (unpublished is {unpublished}): {recipe}",
            recipe,
        )
    published = _canonical(
        column.type, spec.published_value or _obvious_published(column.type, unpublished)
    )
    if not published:
        return Finding(
            "published-flag-value",
            f"{name} is a {column.type} flag (unpublished is {unpublished})",
            "set published_value to the value the relay sets on publish",
        )
    if published == unpublished:
        return Finding(
            "published-flag-value",
            f"published_value and unpublished_value of {name} are both {published!r}",
            "the relay must set a value other than the unpublished one",
        )
    return replace(spec, unpublished_value=unpublished, published_value=published)


def not_null_recipe(schema: str, table: str, column: str) -> str:
    """SET NOT NULL without holding ACCESS EXCLUSIVE through a scan: PostgreSQL 12+ proves it
    from a validated CHECK, and VALIDATE reads the table under SHARE UPDATE EXCLUSIVE. The
    constraint is named in the table's schema by its bare name (a qualified one is a syntax
    error); every name is quoted."""
    rel, col = ident(schema, table), ident(column)
    check = ident(f"{table}_{column}_not_null")
    return (
        f"ALTER TABLE {rel} ADD CONSTRAINT {check} CHECK ({col} IS NOT NULL) NOT VALID; "
        f"ALTER TABLE {rel} VALIDATE CONSTRAINT {check}; ALTER TABLE {rel} ALTER COLUMN "
        f"{col} SET NOT NULL; ALTER TABLE {rel} DROP CONSTRAINT {check}"
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
        if row is not None:
            return relation, MarkerColumn(str(row[0]), row[1], bool(row[2]), bool(row[3]))
    return None


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
    callers' own checks (they name it better). A marker left at its default name that the
    table lacks is taken from the evidence (`infer`)."""
    spec = infer(conn, spec)
    found = read_column(conn, spec)
    if found is None:
        return spec
    relation, column = found
    table = Names(spec).display(spec.table)
    if column.type in TIMESTAMP_TYPES:
        # A NOT NULL timestamp is plan's blocker, not ours: HOPER's optional set-not-null
        # step makes the old table's marker NOT NULL, and the runner must go on after it.
        column = replace(column, not_null=False)
    decided = decide(spec, column, table, to_partition=to_partition)
    if isinstance(decided, Finding):
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


# -- Evidence: which column records delivery, and whether the table keeps delivered rows ------

SAMPLE_ROWS = 1000
"""Rows read to see a column's contents: enough to see a flag's two values, bounded so that
`plan` stays cheap on a large outbox."""
DELIVERY_STEMS = (
    "publish", "dispatch", "sent", "deliver", "process", "relay", "complet", "handled",
    "emit", "ack", "status", "state", "done",
)  # fmt: skip
"""Word beginnings of a column that records delivery (`published_at`, `Dispatched`, `acked`,
`ProcessedDate`, `StatusName`). A name only ranks columns whose type, default and contents
already fit a marker; it never makes one."""
DEADLINE_WORDS = ("by", "until", "deadline", "due", "expire", "expires", "expiry", "expiration",
                  "enqueue", "scheduled", "next", "retry", "lease", "lock", "locked")  # fmt: skip
"""Words of a time that lies ahead of delivery (`deliver_by`, `ExpiresAt`, `EnqueueTime`):
such a column is never suggested, whatever its contents."""
COUNTER_WORDS = ("attempt", "attempts", "retries", "retry", "count", "partition", "version",
                 "priority", "type", "kind", "size", "length", "order", "sequence")  # fmt: skip
"""Words of an integer that counts or orders, not a flag (Wolverine's `attempts`)."""
CHARACTER_TYPES = ("text", "character varying", "character")
FLAG_VALUES = 3
"""Distinct values a flag or status may show: unpublished, published, and failed or dead."""
AHEAD = {
    "timestamp with time zone": "coalesce(bool_or({c} > now() + interval '1 minute'), false)",
    "timestamp without time zone": "coalesce(bool_or({c} > (now() AT TIME ZONE 'UTC') "
    "+ interval '14 hours 1 minute'), false)",
}
"""A value ahead of now: a minute of clock skew allowed; without a time zone the writer may
have meant any zone (UTC+14 the furthest ahead), so only a value beyond all of them counts."""
DELETES_SEEN = 100
"""Deletes `pg_stat_user_tables` must show before they can say how the table delivers."""


@dataclass(frozen=True)
class ColumnSample:
    """A column as the catalog shows it and what a bounded read of its rows found."""

    name: str
    type: str
    default: str | None
    not_null: bool
    rows: int = 0
    nulls: int = 0
    values: tuple[str, ...] = ()
    """Distinct non-NULL values seen, as text, at most a few."""
    distinct: int = 0
    ahead: bool = False
    """A timestamp with values later than now: a deadline or a schedule, not a past event."""


@dataclass(frozen=True)
class Activity:
    """The table's own counters since its statistics were last reset."""

    inserts: int
    updates: int
    deletes: int

    def deletes_on_delivery(self) -> bool:
        """Rows leave by DELETE without first being marked: most inserted rows were deleted,
        and far fewer were ever updated. An outbox that keeps delivered rows marks each one
        (an UPDATE) and deletes, if at all, only what it marked."""
        return (
            self.deletes >= DELETES_SEEN
            and self.deletes * 2 >= self.inserts
            and self.updates * 2 < self.deletes
        )

    def said(self) -> str:
        return (
            f"its statistics show {self.inserts:,} rows inserted, {self.deletes:,} deleted and "
            f"{self.updates:,} updated"
        )


@dataclass(frozen=True)
class Candidate:
    """A column whose type, default and contents fit a publication marker."""

    name: str
    kind: str
    """`timestamp` (NULL = unpublished), `flag` (its constant DEFAULT is the unpublished
    value) or `status` (a text status with no DEFAULT: its values must be set)."""
    why: str
    named: bool
    needs_value: bool = False
    """A flag whose published value is not obvious (a text or enum status)."""

    def setting(self) -> str:
        if self.kind == "status":
            return (
                f'published_column = "{self.name}", unpublished_value = the value a new row '
                "has, published_value = the value the sender sets"
            )
        if self.needs_value:
            return f'published_column = "{self.name}", published_value = the value the sender sets'
        return f'published_column = "{self.name}"'


def words(name: str) -> list[str]:
    """`DispatchedAt` → [dispatched, at]; `deliver_by` → [deliver, by]."""
    return [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)]


def _named(name: str, stems: tuple[str, ...]) -> bool:
    return any(w.startswith(stems) for w in words(name))


def candidate(column: ColumnSample) -> Candidate | None:
    """The column as a marker, or None when its type, default or contents rule it out. A
    timestamp must be nullable with no default and no value ahead of now; a flag needs a
    constant DEFAULT and few values. Without a delivery-like name the contents must show it
    at work (NULL beside set values; the DEFAULT beside another value)."""
    if column.type in TIMESTAMP_TYPES:
        return _timestamp_candidate(column)
    if column.type.endswith("[]") or column.type.startswith(NOT_A_FLAG):
        return None
    if column.type in INTEGER_TYPES and set(words(column.name)) & set(COUNTER_WORDS):
        return None
    return _flag_candidate(column)


def _timestamp_candidate(column: ColumnSample) -> Candidate | None:
    named = _named(column.name, DELIVERY_STEMS)
    ruled_out = (
        column.not_null
        or not (column.default is None or column.default.strip().upper().startswith("NULL"))
        or column.ahead
        or bool(set(words(column.name)) & set(DEADLINE_WORDS))
    )
    if ruled_out or not (named or 0 < column.nulls < column.rows):
        return None
    shown = (
        f"{column.nulls:,} of {column.rows:,} sampled rows NULL" if column.rows else "no rows yet"
    )
    return Candidate(column.name, "timestamp", f"a nullable {column.type}, {shown}", named)


def _flag_candidate(column: ColumnSample) -> Candidate | None:
    named = _named(column.name, DELIVERY_STEMS)
    shown = f"values seen: {', '.join(column.values)}" if column.values else "no rows yet"
    unpublished = _canonical(column.type, constant_default(column.default) or "")
    if not unpublished:
        status = column.type.startswith(CHARACTER_TYPES) and _named(
            column.name, ("status", "state")
        )
        if not status or column.distinct > FLAG_VALUES + 2:
            return None
        return Candidate(column.name, "status", f"{column.type} with no DEFAULT ({shown})", True)
    small = {"-1", "0", "1", "2", "3"}
    if column.distinct > FLAG_VALUES or (
        column.type in INTEGER_TYPES and not set(column.values) <= small
    ):
        return None  # a counter, or an enumeration of many values
    if not (named or any(v != unpublished for v in column.values)):
        return None
    why = f"{column.type} DEFAULT {unpublished} ({shown})"
    obvious = bool(_obvious_published(column.type, unpublished))
    return Candidate(column.name, "flag", why, named, needs_value=not obvious)


def choose(candidates: list[Candidate]) -> Candidate | None:
    """The one marker the evidence points at, or None when it points at none or at several.
    A status needs its values set, so it is suggested, never chosen."""
    usable = [c for c in candidates if c.kind != "status"]
    named = [c for c in usable if c.named]
    if len(named) == 1:
        return named[0]
    return usable[0] if len(usable) == 1 and not named else None


def _worth_sampling(name: str, column_type: str, default: str | None) -> bool:
    """A type a marker can have: a timestamp, or what a partition bound can name as a flag;
    text only with a constant DEFAULT or named as a status, so a text payload is never sorted
    for its distinct values."""
    if column_type in TIMESTAMP_TYPES:
        return True
    if (
        column_type.endswith("[]")
        or column_type.startswith(NOT_A_FLAG)
        or column_type in ("uuid", "numeric", "real", "double precision")
    ):
        return False
    if column_type.startswith(CHARACTER_TYPES):
        return constant_default(default) is not None or _named(name, ("status", "state"))
    return True


def read_samples(
    conn: Connection[Any], schema: str, relation: str, skip: tuple[str, ...] = ()
) -> tuple[list[ColumnSample], Activity]:
    """Every column that could be a marker, with what `SAMPLE_ROWS` rows hold, and the
    table's insert, update and delete counters. Reads a bounded number of rows."""
    reg = ident(schema, relation)
    rows = conn.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod), pg_get_expr(d.adbin, "
        "d.adrelid), a.attnotnull FROM pg_attribute a LEFT JOIN pg_attrdef d "
        "ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
        "WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped "
        "AND a.attgenerated = '' ORDER BY a.attnum",
        (reg,),
    ).fetchall()
    columns = [(str(n), str(t), d, bool(nn)) for n, t, d, nn in rows if n not in skip]
    columns = [c for c in columns if _worth_sampling(c[0], c[1], c[2])]
    stats = conn.execute(
        "SELECT coalesce(n_tup_ins, 0), coalesce(n_tup_upd, 0), coalesce(n_tup_del, 0) "
        "FROM pg_stat_user_tables WHERE relid = to_regclass(%s)",
        (reg,),
    ).fetchone()
    activity = Activity(*(int(v) for v in stats)) if stats else Activity(0, 0, 0)
    if not columns:
        return [], activity
    parts: list[sql.Composable] = [sql.SQL("count(*)")]
    for name, column_type, _d, _nn in columns:
        c = sql.Identifier(name)
        ahead = sql.SQL(AHEAD.get(column_type, "false")).format(c=c)
        parts += [
            sql.SQL("count(*) FILTER (WHERE {c} IS NULL)").format(c=c),
            sql.SQL("count(DISTINCT {c})").format(c=c),
            sql.SQL("(array_agg(DISTINCT {c}::text) FILTER (WHERE {c} IS NOT NULL))[1:6]").format(
                c=c
            ),
            ahead,
        ]
    query = sql.SQL("SELECT {parts} FROM (SELECT {cols} FROM {t} LIMIT {n}) s").format(
        parts=sql.SQL(", ").join(parts),
        cols=sql.SQL(", ").join(sql.Identifier(c[0]) for c in columns),
        t=sql.Identifier(schema, relation),
        n=sql.Literal(SAMPLE_ROWS),
    )
    with conn.transaction():  # a savepoint: a caller's transaction stays usable
        found = conn.execute(query).fetchone()
    assert found is not None
    total, samples = int(found[0]), []
    for i, (name, column_type, default, not_null) in enumerate(columns):
        nulls, distinct, values, ahead = found[1 + 4 * i : 5 + 4 * i]
        samples.append(ColumnSample(
            name, column_type, default, not_null, total, int(nulls),
            tuple(sorted(values or ())), int(distinct), bool(ahead),
        ))  # fmt: skip
    return samples, activity


def infer_from(
    spec: OutboxSpec, has_column: bool, samples: list[ColumnSample], activity: Activity
) -> Candidate | None:
    """The column the evidence makes the marker, when the spec left it at its default name
    and the table has no such column; None otherwise (the judge then says why)."""
    if has_column or spec.published_column != OutboxSpec.published_column:
        return None
    if activity.deletes_on_delivery():
        return None
    chosen = choose([c for s in samples if (c := candidate(s)) is not None])
    return None if chosen is None or chosen.name == spec.id_column else chosen


def infer(conn: Connection[Any], spec: OutboxSpec) -> OutboxSpec:
    """`infer_from` on the live table (or, once it is gone, the partitioned one). Every
    command that reads the outbox resolves through here, so `plan`, `run`, the jobs and the
    relays agree on the marker."""
    if spec.published_column != OutboxSpec.published_column:
        return spec
    for relation in (spec.table, spec.partitioned_table):
        found = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL, EXISTS (SELECT 1 FROM pg_attribute WHERE "
            "attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped)",
            (ident(spec.schema, relation), ident(spec.schema, relation), spec.published_column),
        ).fetchone()
        if not found or not found[0]:
            continue
        if found[1]:
            return spec
        samples, activity = read_samples(conn, spec.schema, relation, (spec.id_column,))
        chosen = infer_from(spec, False, samples, activity)
        return spec if chosen is None else replace(spec, published_column=chosen.name)
    return spec
