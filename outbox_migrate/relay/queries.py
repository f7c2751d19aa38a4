"""Every SQL statement the relay runs, as inert `Composed` objects. A statement with nothing
to compose is a named block of sql/relay.sql; the others are built here from outbox-dependent
parts (marker, id kind, column types, relations, sharding) a named block would only skeleton.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import marker
from outbox_migrate.sql import query

CLAIM_CTID_COLUMN = 6
"""Position of `ctid` in a claimed row; the columns before it are a `Message`."""
CLAIM_HEADERS_COLUMN = 7
"""The extra headers ([name, value] pairs) when the outbox carries any; NULL when the row's
json headers are not an object (a bad row)."""
CLAIM_TEXT_HEADERS_COLUMN = 8
"""A non-json headers column as text: a cast in SQL would fail the claim on one bad row."""


@dataclass(frozen=True)
class Source:
    label: str
    """schema.table: in logs, keys and the attempts and dead-letter rows."""
    schema: str
    claim_table: str
    """Flat table, or the unpublished partition."""
    mark_table: str
    """Flat table, or the partitioned parent (the UPDATE must route the row)."""
    id_column: str
    published_column: str
    partitioned: bool
    text_ids: bool = False
    """Application ids (uuid, ULID): claimed as text in `order_column` order, no id cursor."""
    order_column: str = ""
    flag: marker.Marker | None = None
    """None: a timestamp marker."""
    name: str = ""
    """The outbox's name in messages, stable across flat/partitioned and the rename ("": label)."""
    claim_oid: int = 0
    """The OID `claim_table` named at start (0: unresolved). Marks by ctid are confined to it:
    a ctid means nothing without its table, and a rolled-back rename may repoint the name."""

    @property
    def marker(self) -> marker.Marker:
        return self.flag or marker.Marker(self.published_column, "", "")

    @property
    def claim_ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.claim_table)

    @property
    def mark_ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.mark_table)

    def same_relation(self) -> sql.Composable:
        """` AND tableoid = <claim_oid>`: a mark changes rows of the claimed relation only."""
        if not self.claim_oid:
            return sql.SQL("")
        return sql.SQL(" AND tableoid = {}::oid").format(sql.Literal(self.claim_oid))

    def unpublished_filter(self) -> sql.Composable:
        if self.partitioned:
            return sql.SQL("true")
        return marker.unpublished(self.marker)


def flat_source(spec: OutboxSpec) -> Source:
    return _source(spec, f"{spec.schema}.{spec.table}", spec.table, spec.table, False)


def partitioned_source(spec: OutboxSpec) -> Source:
    label = f"{spec.schema}.{spec.partitioned_table}"
    return _source(spec, label, spec.unpublished_partition, spec.partitioned_table, True)


def _source(spec: OutboxSpec, label: str, claim: str, mark: str, partitioned: bool) -> Source:
    ids: dict[str, Any] = {}
    if spec.id_kind == "application":
        order = spec.order_column if spec.order_column != spec.id_column else ""
        ids = {"text_ids": True, "order_column": order}
    return Source(
        label=label,
        schema=spec.schema,
        claim_table=claim,
        mark_table=mark,
        id_column=spec.id_column,
        published_column=spec.published_column,
        partitioned=partitioned,
        flag=marker.of(spec),
        name=f"{spec.schema}.{spec.outbox_name}",
        **ids,
    )


@dataclass(frozen=True)
class Columns:
    event_type: str | None
    key: str | None
    payload: str = "payload"
    created_at: str | None = "created_at"
    """None: the outbox has no creation timestamp; the claim's time stands in for it."""
    payload_type: str = "jsonb"
    headers: str | None = None
    headers_type: str = "jsonb"
    """json/jsonb are read by the server; any other type is parsed per row by the relay."""
    metadata: tuple[str, ...] = ()

    @property
    def carries_headers(self) -> bool:
        return bool(self.headers or self.metadata)

    @property
    def text_headers(self) -> bool:
        return bool(self.headers) and self.headers_type not in ("json", "jsonb")


def _optional(column: str | None) -> sql.Composable:
    """A key or event-type column of any type as text (a cast that cannot fail on a row)."""
    return sql.SQL("{}::text").format(sql.Identifier(column)) if column else sql.SQL("NULL::text")


def payload_expression(columns: Columns) -> sql.Composable:
    """json/jsonb/text as text; bytea as bytes, decoded by the relay (relay/claimed.py): a
    `convert_from` in the claim would fail the whole batch on one body that is not UTF-8."""
    payload = sql.Identifier(columns.payload)
    if columns.payload_type == "bytea":
        return payload
    return sql.SQL("{}::text").format(payload)


def created_expression(columns: Columns) -> sql.Composable:
    if columns.created_at:
        return sql.Identifier(columns.created_at)
    return sql.SQL("now()")


RFC3339 = 'YYYY-MM-DD"T"HH24:MI:SS.USTZH:TZM'
"""`to_char` format of a timestamptz as RFC 3339 (in the session's time zone, with offset)."""


def created_text_expression(columns: Columns) -> sql.Composable:
    """The creation time as RFC 3339 text, what every sink sends, rendered by the server:
    formatting per message in Python is costly (bench/README.md) and the relay never needs
    the datetime itself. A `timestamp` column is taken as session-local time."""
    return sql.SQL("to_char({}::timestamptz, {})").format(
        created_expression(columns), sql.Literal(RFC3339)
    )


def extra_headers_expression(columns: Columns) -> sql.Composable:
    """Broker headers as a text[] of [name, value] pairs, NULLs left out: the headers
    object's entries, then the metadata columns (which win over a same-named entry)."""
    parts: list[sql.Composable] = []
    json_headers = None if columns.text_headers else columns.headers
    if json_headers:
        parts.append(_headers_object(json_headers))
    if columns.metadata:
        pairs = sql.SQL(", ").join(
            sql.SQL("{}, {}::text").format(sql.Literal(name), sql.Identifier(name))
            for name in columns.metadata
        )
        parts.append(sql.SQL("jsonb_build_object({})").format(pairs))
    merged = sql.SQL(" || ").join(parts) if parts else sql.SQL("'{}'::jsonb")
    pairs = sql.SQL(
        "ARRAY(SELECT ARRAY[e.key, e.value] FROM jsonb_each_text({}) AS e "
        "WHERE e.value IS NOT NULL)"
    ).format(merged)
    if not json_headers:
        return pairs
    # NULL (not an empty array) marks a row whose headers are not an object: a bad row.
    return sql.SQL("CASE WHEN jsonb_typeof({h}) = 'object' THEN {pairs} END").format(
        h=_headers_object(json_headers), pairs=pairs
    )


def _headers_object(column: str) -> sql.Composable:
    """The headers as jsonb; SQL NULL and JSON null both mean "no headers"."""
    return sql.SQL("coalesce(nullif({}::jsonb, 'null'), '{{}}')").format(sql.Identifier(column))


def shard_expression(source: Source, columns: Columns, *, by_key: bool) -> sql.Composable:
    """Which shard a row belongs to, in [0, %(shards)s). `hashtext` is int4 (maybe negative):
    shifted into int8 before `mod`, no negative shard and no `abs(-2^31)` overflow."""
    if by_key and columns.key:
        return sql.SQL("mod(hashtext(coalesce({key}::text, ''))::int8 + 2147483648, %(shards)s)")\
            .format(key=sql.Identifier(columns.key))  # fmt: skip
    if source.text_ids:
        return sql.SQL("mod(hashtext({id}::text)::int8 + 2147483648, %(shards)s)").format(
            id=sql.Identifier(source.id_column)
        )
    return sql.SQL("mod({id}, %(shards)s)").format(id=sql.Identifier(source.id_column))


def claim(source: Source, columns: Columns, *, sharded: bool, by_key: bool) -> sql.Composed:
    """Claim and lock the next batch of this session's shards, oldest id first (params:
    after, limit; sharded: shards, mine)."""
    shard = (
        sql.SQL(" AND {} = ANY(%(mine)s)").format(shard_expression(source, columns, by_key=by_key))
        if sharded
        else sql.SQL("")
    )
    if source.text_ids:
        # Application ids: oldest first by `order_column`, then id, always from the start: a
        # uuid has no successor and a timestamp order may get rows below the last claimed, so
        # there is no cursor (docs/relay.md: the cost under a held xmin).
        order = [sql.Identifier(source.id_column)]
        if source.order_column:
            order.insert(0, sql.Identifier(source.order_column))
        return _locked(source, columns, shard, sql.SQL(", ").join(order))
    ident = sql.Identifier(source.id_column)
    return _locked(source, columns, sql.SQL(" AND {} > %(after)s{}").format(ident, shard), ident)


def _locked(
    source: Source, columns: Columns, where: sql.Composable, order: sql.Composable | None
) -> sql.Composed:
    """The unpublished rows `where` selects, locked skipping those locked already; with
    `order`, the first %(limit)s in that order."""
    limit = (
        sql.SQL(" ORDER BY {} LIMIT %(limit)s").format(order) if order is not None else sql.SQL("")
    )
    return sql.SQL(
        "SELECT {columns} FROM {table} WHERE {unpublished}{where}{limit} FOR UPDATE SKIP LOCKED"
    ).format(
        columns=claimed_columns(source, columns),
        table=source.claim_ident,
        unpublished=source.unpublished_filter(),
        where=where,
        limit=limit,
    )


def claimed_columns(source: Source, columns: Columns) -> sql.Composed:
    return sql.SQL(
        "{id}, {label}::text, {event_type}, {key}, {payload}, {created_at}, ctid{headers}"
    ).format(
        id=sql.SQL("{}::text").format(sql.Identifier(source.id_column))
        if source.text_ids
        else sql.Identifier(source.id_column),
        label=sql.Literal(source.name or source.label),
        event_type=_optional(columns.event_type),
        key=_optional(columns.key),
        payload=payload_expression(columns),
        created_at=created_text_expression(columns),
        headers=_headers_columns(columns),
    )


def _headers_columns(columns: Columns) -> sql.Composable:
    if not columns.carries_headers:
        return sql.SQL("")
    pairs = sql.SQL(", {}").format(extra_headers_expression(columns))
    if not columns.text_headers:
        return pairs
    assert columns.headers is not None
    return sql.SQL("{}, {}::text").format(pairs, sql.Identifier(columns.headers))


def probe(source: Source, columns: Columns) -> sql.Composed:
    """Claim the given ids (param: ids) if unpublished now: gaps the cursor jumped over. No
    ORDER BY (the worker sorts the few rows); one index descent per id."""
    where = sql.SQL(" AND {} = ANY(%(ids)s::int8[])").format(sql.Identifier(source.id_column))
    return _locked(source, columns, where, None)


def horizon() -> sql.Composed:
    return named("horizon")


def try_idle_lock() -> sql.Composed:
    """Raise the idle flag the wake-up trigger looks at (param: key). A try, never a wait:
    it fails while a writer that saw the relay busy is uncommitted; the worker looks again."""
    return named("try-idle-lock")


def mark(source: Source) -> sql.Composed:
    """Mark claimed rows by ctid (param: tids). The claim's lock keeps ctids stable until
    commit, and a TID scan skips one index descent per row. Through the parent, so the row
    moves partition; the unpublished filter prunes the scan and makes a re-run a no-op."""
    return sql.SQL(
        "UPDATE {table} SET {mark} WHERE {unpublished} AND ctid = ANY(%(tids)s::tid[]){same}"
    ).format(
        table=source.mark_ident,
        mark=marker.mark(source.marker),
        unpublished=marker.unpublished(source.marker),
        same=source.same_relation(),
    )


def claim_and_mark(source: Source, *, sharded: bool) -> sql.Composed:
    """Claim and mark in one statement: the SQL-only limit the bench measures."""
    shard = (
        sql.SQL(" AND mod({id}, %(shards)s) = ANY(%(mine)s)").format(
            id=sql.Identifier(source.id_column)
        )
        if sharded
        else sql.SQL("")
    )
    return sql.SQL(
        "WITH batch AS (SELECT {id} FROM {claim} WHERE {unpublished}{shard} "
        "ORDER BY {id} LIMIT %(limit)s FOR UPDATE SKIP LOCKED) "
        "UPDATE {mark} AS o SET {set} FROM batch "
        "WHERE {marked} AND o.{id} = batch.{id}"
    ).format(
        id=sql.Identifier(source.id_column),
        claim=source.claim_ident,
        mark=source.mark_ident,
        unpublished=source.unpublished_filter(),
        set=marker.mark(source.marker),
        marked=marker.unpublished(source.marker, "o"),
        shard=shard,
    )


def claim_session_settings() -> sql.Composed:
    return named("claim-session-settings")


def qualified(schema: str, table: str) -> str:
    """Text that `to_regclass` resolves to exactly this relation (quoted identifiers)."""
    return ".".join('"' + name.replace('"', '""') + '"' for name in (schema, table))


def backlog(source: Source, columns: Columns) -> sql.Composed:
    return sql.SQL(
        "SELECT count(*), coalesce(extract(epoch FROM now() - min({created_at})), 0)::float8 "
        "FROM {table} WHERE {unpublished}"
    ).format(
        created_at=created_expression(columns),
        table=source.claim_ident,
        unpublished=source.unpublished_filter(),
    )


def has_unpublished(source: Source) -> sql.Composed:
    return sql.SQL("SELECT EXISTS (SELECT FROM {table} WHERE {unpublished})").format(
        table=source.claim_ident, unpublished=source.unpublished_filter()
    )


def lock_for_switch(source: Source) -> sql.Composed:
    """Once granted, no transaction that wrote the table is open (relay/switching.py)."""
    return sql.SQL("LOCK TABLE {} IN SHARE MODE").format(source.mark_ident)


@cache
def named(name: str) -> sql.Composed:
    """A statement of sql/relay.sql (its comment there says what it does and takes)."""
    return query("relay", name).compose()
