"""Every SQL statement the relay runs, composed with `psycopg.sql` from the names in force.

Builders return inert `Composed` objects; nothing here holds a connection. Identifiers always
go through `sql.Identifier`; values are bound parameters (`%(name)s`). A statement with nothing
to compose is a named block of sql/relay.sql, like the runner's. The claim, the mark, the
backlog and the switch's statements stay here, built in Python: each is assembled from parts
that depend on the outbox (its marker — a timestamp or a flag —, id kind, payload and headers
types, the claim's and the mark's relations, sharding), so a named block would be a skeleton
of placeholders and the reader would need both files to see one statement. Utility commands
that are one composed identifier (LISTEN in relay/listener.py, set_config in relay/keepalive.py,
the demo writer's INSERT of the configured columns in relay/writer.py) stay where they run.

Claim design (why the claim is sharded, see docs/relay.md): on a LIST-partitioned outbox the
mark moves a row to another partition. A claimer whose statement snapshot predates another
claimer's commit then tries to lock a row that has *moved*, and PostgreSQL raises SQLSTATE 40001
even under SKIP LOCKED. Claimers therefore never compete for the same rows: the id space is split
into shards (`id % shards`, or a hash of the key), each owned by one session through an advisory
lock, and `FOR UPDATE SKIP LOCKED` stays as the safety net against claimers outside the scheme.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import marker
from outbox_migrate.sql import query

ADVISORY_NAMESPACE = "outbox-migrate.relay"
CLAIM_CTID_COLUMN = 6
"""Position of `ctid` in a claimed row; the columns before it are a `Message`."""
CLAIM_HEADERS_COLUMN = 7
"""Position of the extra headers ([name, value] pairs), present only when the outbox has a
headers column or metadata columns (`Columns.carries_headers`); NULL when the row's json
headers are not a JSON object (a bad row, relay/claimed.py)."""
CLAIM_TEXT_HEADERS_COLUMN = 8
"""Position of a headers column that is not json/jsonb, as text: parsed per row by the relay
(a cast in SQL would fail the whole claim on one row that is not JSON)."""


@dataclass(frozen=True)
class Source:
    """One table the relay publishes from: where it claims and where it marks."""

    label: str
    """The relation's name in logs, keys and the attempts and dead-letter rows
    (schema.table)."""
    schema: str
    claim_table: str
    """Flat table, or the unpublished partition (its id index serves the claim)."""
    mark_table: str
    """Flat table, or the partitioned parent (the UPDATE must route the row)."""
    id_column: str
    published_column: str
    partitioned: bool
    text_ids: bool = False
    """Application ids (uuid, ULID): claimed as text in `order_column` order, no id cursor."""
    order_column: str = ""
    """The claim order of application ids ("" = the id itself)."""
    flag: marker.Marker | None = None
    """A flag marker (and status column) from the spec; None = a timestamp marker."""
    name: str = ""
    """The outbox's name in messages (schema + `OutboxSpec.outbox_name`, the same for the
    flat and the partitioned source and across the rename); "" = `label`."""
    claim_oid: int = 0
    """The OID `claim_table` named when the relay started (relay/marker_source.py); 0: not
    resolved (SQL built without a session). Every mark by ctid is confined to it
    (`same_relation`): a ctid means nothing without its table, and by the time of a mark the
    mark's name may mean another one (a rename rolled back under a running relay)."""

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
        """` AND tableoid = <claim_oid>`: a mark changes rows of the claimed relation only,
        whatever its name means now (one integer comparison per marked row)."""
        if not self.claim_oid:
            return sql.SQL("")
        return sql.SQL(" AND tableoid = {}::oid").format(sql.Literal(self.claim_oid))

    def unpublished_filter(self) -> sql.Composable:
        """The flat table needs `published_at IS NULL` (`published = 0`); the unpublished
        partition holds nothing else."""
        if self.partitioned:
            return sql.SQL("true")
        return marker.unpublished(self.marker)


def flat_source(spec: OutboxSpec) -> Source:
    return Source(
        label=f"{spec.schema}.{spec.table}",
        schema=spec.schema,
        claim_table=spec.table,
        mark_table=spec.table,
        id_column=spec.id_column,
        published_column=spec.published_column,
        partitioned=False,
        flag=marker.of(spec),
        name=f"{spec.schema}.{spec.outbox_name}",
        **_id_handling(spec),
    )


def partitioned_source(spec: OutboxSpec) -> Source:
    return Source(
        label=f"{spec.schema}.{spec.partitioned_table}",
        schema=spec.schema,
        claim_table=spec.unpublished_partition,
        mark_table=spec.partitioned_table,
        id_column=spec.id_column,
        published_column=spec.published_column,
        partitioned=True,
        flag=marker.of(spec),
        name=f"{spec.schema}.{spec.outbox_name}",
        **_id_handling(spec),
    )


def _id_handling(spec: OutboxSpec) -> dict[str, Any]:
    if spec.id_kind != "application":
        return {}
    order = spec.order_column if spec.order_column != spec.id_column else ""
    return {"text_ids": True, "order_column": order}


@dataclass(frozen=True)
class Columns:
    """The columns the relay reads besides the id, resolved against the live table from the
    `OutboxSpec`'s column roles (see `columns.resolve`)."""

    event_type: str | None
    key: str | None
    payload: str = "payload"
    created_at: str | None = "created_at"
    """None: the outbox has no creation timestamp; the claim's time stands in for it."""
    payload_type: str = "jsonb"
    headers: str | None = None
    """A column holding a JSON object whose entries become broker headers."""
    headers_type: str = "jsonb"
    """Its type: json/jsonb are read by the server; any other (text, varchar) is parsed per
    row by the relay."""
    metadata: tuple[str, ...] = ()
    """Columns sent as broker headers, named after the column."""

    @property
    def carries_headers(self) -> bool:
        return bool(self.headers or self.metadata)

    @property
    def text_headers(self) -> bool:
        """The headers column is parsed by the relay (not json/jsonb)."""
        return bool(self.headers) and self.headers_type not in ("json", "jsonb")


def _optional(column: str | None) -> sql.Composable:
    """A key or event-type column of any type (uuid, bigint, an enum) as text: the claim
    hands strings to the sinks, and a cast cannot fail on a row."""
    return sql.SQL("{}::text").format(sql.Identifier(column)) if column else sql.SQL("NULL::text")


def payload_expression(columns: Columns) -> sql.Composable:
    """The payload: json/jsonb/text as text; bytea as stored (bytes), decoded by the relay
    (relay/claimed.py) — `convert_from` in the claim failed the whole batch on one body that
    is not UTF-8 (a pickle), and the relay sends such a body as bytes instead."""
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
    """The creation time as RFC 3339 text, which is what every sink sends.

    Rendered by the server in the claim rather than loaded as a datetime and formatted by the
    relay: `datetime.isoformat()` per message is a large share of the relay's per-message
    work at big batches (bench/README.md, relay.py), and the relay never needs the datetime
    itself (`Message.created_at` parses it on demand). A `timestamp` column is taken as
    the session's local time, as a cast to timestamptz does."""
    return sql.SQL("to_char({}::timestamptz, {})").format(
        created_expression(columns), sql.Literal(RFC3339)
    )


def extra_headers_expression(columns: Columns) -> sql.Composable:
    """Broker headers from the row: the headers object's entries, then the metadata columns
    (a metadata column wins over a same-named entry), as a two-dimensional text[] of
    [name, value] pairs; NULL values are left out. Selected only when configured, so the hot
    loop pays nothing for outboxes without metadata."""
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
    """Which shard a row belongs to, in [0, %(shards)s).

    `hashtext` returns int4 (possibly negative); shifting it into int8 before `mod` avoids both
    a negative shard and `abs(-2^31)` overflowing.
    """
    if by_key and columns.key:
        return sql.SQL("mod(hashtext(coalesce({key}::text, ''))::int8 + 2147483648, %(shards)s)")\
            .format(key=sql.Identifier(columns.key))  # fmt: skip
    if source.text_ids:
        return sql.SQL("mod(hashtext({id}::text)::int8 + 2147483648, %(shards)s)").format(
            id=sql.Identifier(source.id_column)
        )
    return sql.SQL("mod({id}, %(shards)s)").format(id=sql.Identifier(source.id_column))


def claim(source: Source, columns: Columns, *, sharded: bool, by_key: bool) -> sql.Composed:
    """Claim the next batch of this session's shards, oldest id first, locking the rows.

    Parameters: after (id cursor), limit, and when sharded shards + mine (int[]). The columns
    come back in `Message` field order (the outbox's name as a constant second column), then
    the row's `ctid` (CLAIM_CTID_COLUMN), which the mark uses to find it again, then, when the
    outbox carries metadata, the extra headers (CLAIM_HEADERS_COLUMN).
    The cursor (`id > %(after)s`) lets a claim start where the last one ended instead of
    re-walking index entries of rows just moved out (they stay in the index until vacuum, and a
    held xmin keeps them there); the worker resets it to 0 regularly so a row whose transaction
    committed late (a lower id) is still found.
    """
    shard = (
        sql.SQL(" AND {} = ANY(%(mine)s)").format(shard_expression(source, columns, by_key=by_key))
        if sharded
        else sql.SQL("")
    )
    if source.text_ids:
        return _claim_in_order(source, columns, shard)
    return sql.SQL(
        "SELECT {columns} FROM {table} WHERE {unpublished} AND {id} > %(after)s{shard} "
        "ORDER BY {id} LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
    ).format(
        columns=claimed_columns(source, columns),
        id=sql.Identifier(source.id_column),
        table=source.claim_ident,
        unpublished=source.unpublished_filter(),
        shard=shard,
    )


def _claim_in_order(source: Source, columns: Columns, shard: sql.Composable) -> sql.Composed:
    """Application ids: oldest first by `order_column` (ties by id), always from the start.

    A uuid or ULID has no successor to resume after, and a timestamp order may receive rows
    below the last one claimed at any time, so there is no cursor: the claim walks the
    unpublished partition's (order_column, id) index from its start (docs/relay.md says
    what that costs under a held xmin)."""
    order = [sql.Identifier(source.id_column)]
    if source.order_column:
        order.insert(0, sql.Identifier(source.order_column))
    return sql.SQL(
        "SELECT {columns} FROM {table} WHERE {unpublished}{shard} "
        "ORDER BY {order} LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
    ).format(
        columns=claimed_columns(source, columns),
        table=source.claim_ident,
        unpublished=source.unpublished_filter(),
        shard=shard,
        order=sql.SQL(", ").join(order),
    )


def claimed_columns(source: Source, columns: Columns) -> sql.Composed:
    """What a claim returns: `Message` fields, ctid, and the extra headers if any."""
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
    """Claim the given ids (parameter: ids, int8[]) if they are unpublished now: the gaps the
    cursor jumped over (a transaction that committed late). Same columns as `claim`; no
    ORDER BY (the worker sorts the few rows), one index descent per id however far the
    cursor has moved on."""
    return sql.SQL(
        "SELECT {columns} FROM {table} WHERE {unpublished} AND {id} = ANY(%(ids)s::int8[]) "
        "FOR UPDATE SKIP LOCKED"
    ).format(
        columns=claimed_columns(source, columns),
        id=sql.Identifier(source.id_column),
        table=source.claim_ident,
        unpublished=source.unpublished_filter(),
    )


def horizon() -> sql.Composed:
    """The transaction horizon as integers: the oldest xid still running and the first xid not
    yet assigned (relay/cursor.py: an unaccounted region is settled once xmin reaches the xmax
    read after it opened). Read only while a region is open."""
    return _named("horizon")


def try_idle_lock() -> sql.Composed:
    """Raise the idle flag the wake-up trigger looks at (param: key, `notify.idle_lock_key`).

    A try, never a wait: it fails while a writer that saw the relay busy has not committed yet
    (or while another worker holds the flag), and the worker then looks again shortly."""
    return _named("try-idle-lock")


def idle_unlock() -> sql.Composed:
    """Lower the idle flag: writers stop notifying (the relay is claiming anyway)."""
    return _named("idle-unlock")


def mark(source: Source) -> sql.Composed:
    """Set the publication time of claimed rows by ctid (parameter: tids, a tid[] literal).

    By ctid, not id: the rows are locked by this transaction's claim, so their ctids cannot
    change until the commit, and a TID scan fetches each row directly where `id = ANY(…)`
    descends the id index once per row (more batches per second: bench/README.md). Through the
    parent on the partitioned outbox, so PostgreSQL moves each row to the
    published partition; `published_at IS NULL` prunes the scan to the unpublished partition
    and keeps a re-run from touching a row twice. `tableoid` confines it to the relation
    the rows were claimed from (`Source.same_relation`); a mark that changes fewer rows than
    it was given is looked into by the worker (relay/marker_source.py `check_names`).
    """
    return sql.SQL(
        "UPDATE {table} SET {mark} WHERE {unpublished} AND ctid = ANY(%(tids)s::tid[]){same}"
    ).format(
        table=source.mark_ident,
        mark=marker.mark(source.marker),
        unpublished=marker.unpublished(source.marker),
        same=source.same_relation(),
    )


def claim_and_mark(source: Source, *, sharded: bool) -> sql.Composed:
    """Claim and mark in one statement (no broker): the SQL-only limit the bench measures."""
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
    """Settings of a claiming session: walk the id index, never scan-and-sort (see worker)."""
    return _named("claim-session-settings")


def try_lock_shards() -> sql.Composed:
    """Session advisory locks on up to %(limit)s free shards, in the order given.

    No ORDER BY: the Limit node stops pulling rows, so no lock beyond the limit is taken.
    """
    return _named("try-lock-shards")


def unlock_shards() -> sql.Composed:
    return _named("unlock-shards")


def end_idle_shard_holders() -> sql.Composed:
    """End the sessions that hold a shard of this outbox but have not heard from their client
    for longer than %(after_s)s seconds; returns (pid, silent seconds, ended).

    Silent means waiting for the client: idle, idle in a transaction, or `active` in
    ClientRead — a pipeline frozen between its statements and their Sync. See
    `ShardLease.reap` for why the server's own timers do not cover every such moment. The
    silence is measured from the later of the state change and the statement start, so no
    session is ended sooner after its last message than the server's timers would end it.
    """
    return _named("end-idle-shard-holders")


def join_members() -> sql.Composed:
    """A shared session lock that marks this session as a live worker of the outbox."""
    return _named("join-members")


def leave_members() -> sql.Composed:
    """Stop counting as a live worker (a worker whose broker is unreachable steps out)."""
    return _named("leave-members")


def qualified(schema: str, table: str) -> str:
    """Text that `to_regclass` resolves to exactly this relation (quoted identifiers)."""
    return ".".join('"' + name.replace('"', '""') + '"' for name in (schema, table))


def names_now() -> sql.Composed:
    """What the relay's names mean now (params: claim, mark — `qualified` text; claim_oid):
    the OID of the claim's name, and whether the mark's name reaches the relation claimed
    from — that relation itself (flat), a partitioned table it belongs to, or a view over
    one (the view the rename to the original name leaves under the former name)."""
    return _named("names-now")


def table_exists() -> sql.Composed:
    """Whether %(schema)s.%(table)s exists (needs no privilege on it)."""
    return _named("table-exists")


def count_members() -> sql.Composed:
    """Live workers of the outbox: sessions holding the shared membership lock.

    Two-int4 advisory locks show up in pg_locks as classid = key1 (an oid, so the int4 hash is
    compared as unsigned), objid = key2, objsubid = 2.
    """
    return _named("count-members")


def table_columns() -> sql.Composed:
    """Column names and base types of a relation (params: schema, table); empty when it does
    not exist."""
    return _named("table-columns")


def backlog(source: Source, columns: Columns) -> sql.Composed:
    """Unpublished rows and the age of the oldest one, in seconds (for the metrics)."""
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
    """SHARE conflicts with the ROW EXCLUSIVE lock every INSERT (and our UPDATE) holds to its
    transaction's end: once granted, no transaction that wrote the table is still open."""
    return sql.SQL("LOCK TABLE {} IN SHARE MODE").format(source.mark_ident)


def roles_that_can_insert() -> sql.Composed:
    """Login roles a REVOKE can stop that may still INSERT into the table (params: relation).

    Superusers, the owner and members of the owner role are left out: a REVOKE does not stop
    them for good (the owner grants itself back), so their *sessions* are the gate's business
    instead (relay/switch_evidence.py). INSERT granted on some columns only counts too
    (`has_any_column_privilege`; `has_table_privilege` sees table-level grants only).
    """
    return _named("roles-that-can-insert")


def old_app_sessions() -> sql.Composed:
    """Sessions of the outgoing application in this database (param: pattern, a LIKE)."""
    return _named("old-app-sessions")


@cache
def _named(name: str) -> sql.Composed:
    """A statement of sql/relay.sql with nothing to compose (names and values are parameters)."""
    return query("relay", name).compose()
