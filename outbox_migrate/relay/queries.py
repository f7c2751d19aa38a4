"""Every SQL statement the relay runs, composed with `psycopg.sql` from the names in force.

Builders return inert `Composed` objects; nothing here holds a connection. Identifiers always
go through `sql.Identifier`; values are bound parameters (`%(name)s`).

Claim design (why the claim is sharded, see docs/relay.md): on a LIST-partitioned outbox the
mark moves a row to another partition. A claimer whose statement snapshot predates another
claimer's commit then tries to lock a row that has *moved*, and PostgreSQL raises SQLSTATE 40001
even under SKIP LOCKED. Claimers therefore never compete for the same rows: the id space is split
into shards (`id % shards`, or a hash of the key), each owned by one session through an advisory
lock, and `FOR UPDATE SKIP LOCKED` stays as the safety net against claimers outside the scheme.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from outbox_migrate.config import OutboxSpec

ADVISORY_NAMESPACE = "outbox-migrate.relay"
CLAIM_CTID_COLUMN = 6
"""Position of `ctid` in a claimed row; the columns before it are a `Message`."""


@dataclass(frozen=True)
class Source:
    """One table the relay publishes from: where it claims and where it marks."""

    label: str
    """Name reported in messages and logs (schema.table)."""
    schema: str
    claim_table: str
    """Flat table, or the unpublished partition (its id index serves the claim)."""
    mark_table: str
    """Flat table, or the partitioned parent (the UPDATE must route the row)."""
    id_column: str
    published_column: str
    partitioned: bool

    @property
    def claim_ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.claim_table)

    @property
    def mark_ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.mark_table)

    def unpublished_filter(self) -> sql.Composable:
        """The flat table needs `published_at IS NULL`; the NULL partition holds nothing else."""
        if self.partitioned:
            return sql.SQL("true")
        return sql.SQL("{} IS NULL").format(sql.Identifier(self.published_column))


def flat_source(spec: OutboxSpec) -> Source:
    return Source(
        label=f"{spec.schema}.{spec.table}",
        schema=spec.schema,
        claim_table=spec.table,
        mark_table=spec.table,
        id_column=spec.id_column,
        published_column=spec.published_column,
        partitioned=False,
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
    )


@dataclass(frozen=True)
class Columns:
    """Optional columns the relay reads besides id, payload and created_at."""

    event_type: str | None
    key: str | None
    payload: str = "payload"
    created_at: str = "created_at"


def _optional(column: str | None) -> sql.Composable:
    return sql.Identifier(column) if column else sql.SQL("NULL::text")


def shard_expression(source: Source, columns: Columns, *, by_key: bool) -> sql.Composable:
    """Which shard a row belongs to, in [0, %(shards)s).

    `hashtext` returns int4 (possibly negative); shifting it into int8 before `mod` avoids both
    a negative shard and `abs(-2^31)` overflowing.
    """
    if by_key and columns.key:
        return sql.SQL("mod(hashtext(coalesce({key}::text, ''))::int8 + 2147483648, %(shards)s)")\
            .format(key=sql.Identifier(columns.key))  # fmt: skip
    return sql.SQL("mod({id}, %(shards)s)").format(id=sql.Identifier(source.id_column))


def claim(source: Source, columns: Columns, *, sharded: bool, by_key: bool) -> sql.Composed:
    """Claim the next batch of this session's shards, oldest id first, locking the rows.

    Parameters: after (id cursor), limit, and when sharded shards + mine (int[]). The columns
    come back in `Message` field order (the source's label as a constant second column), then
    the row's `ctid` (CLAIM_CTID_COLUMN), which the mark uses to find it again.
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
    return sql.SQL(
        "SELECT {id}, {label}::text, {event_type}, {key}, {payload}::text, {created_at}, ctid "
        "FROM {table} WHERE {unpublished} AND {id} > %(after)s{shard} "
        "ORDER BY {id} LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
    ).format(
        id=sql.Identifier(source.id_column),
        label=sql.Literal(source.label),
        event_type=_optional(columns.event_type),
        key=_optional(columns.key),
        payload=sql.Identifier(columns.payload),
        created_at=sql.Identifier(columns.created_at),
        table=source.claim_ident,
        unpublished=source.unpublished_filter(),
        shard=shard,
    )


def mark(source: Source) -> sql.Composed:
    """Set the publication time of claimed rows by ctid (parameter: tids, a tid[] literal).

    By ctid, not id: the rows are locked by this transaction's claim, so their ctids cannot
    change until the commit, and a TID scan fetches each row directly where `id = ANY(…)`
    descends the id index once per row (measured: about 15 % more batches per second at batch
    100). Through the parent on the partitioned outbox, so PostgreSQL moves each row to the
    published partition; `published_at IS NULL` prunes the scan to the unpublished partition
    and keeps a re-run from touching a row twice.
    """
    return sql.SQL(
        "UPDATE {table} SET {published} = now() "
        "WHERE {published} IS NULL AND ctid = ANY(%(tids)s::tid[])"
    ).format(
        table=source.mark_ident,
        published=sql.Identifier(source.published_column),
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
        "UPDATE {mark} AS o SET {published} = now() FROM batch "
        "WHERE o.{published} IS NULL AND o.{id} = batch.{id}"
    ).format(
        id=sql.Identifier(source.id_column),
        claim=source.claim_ident,
        mark=source.mark_ident,
        unpublished=source.unpublished_filter(),
        published=sql.Identifier(source.published_column),
        shard=shard,
    )


def claim_session_settings() -> sql.SQL:
    """Settings of a claiming session: walk the id index, never scan-and-sort (see worker)."""
    return sql.SQL("SET enable_sort = off")


def try_lock_shards() -> sql.SQL:
    """Session advisory locks on up to %(limit)s free shards, in the order given.

    No ORDER BY: the Limit node stops pulling rows, so no lock beyond the limit is taken.
    """
    return sql.SQL(
        "SELECT s FROM unnest(%(shards)s::int[]) AS s "
        "WHERE pg_try_advisory_lock(hashtext(%(key)s), s) LIMIT %(limit)s"
    )


def unlock_shards() -> sql.SQL:
    return sql.SQL(
        "SELECT pg_advisory_unlock(hashtext(%(key)s), s) FROM unnest(%(shards)s::int[]) AS s"
    )


def join_members() -> sql.SQL:
    """A shared session lock that marks this session as a live worker of the outbox."""
    return sql.SQL("SELECT pg_advisory_lock_shared(hashtext(%(key)s), 0)")


def count_members() -> sql.SQL:
    """Live workers of the outbox: sessions holding the shared membership lock.

    Two-int4 advisory locks show up in pg_locks as classid = key1 (an oid, so the int4 hash is
    compared as unsigned), objid = key2, objsubid = 2.
    """
    return sql.SQL(
        "SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND classid::int8 = (hashtext(%(key)s)::int8 & 4294967295) AND objid::int8 = 0 "
        "AND objsubid = 2"
    )


def table_columns() -> sql.SQL:
    """Column names of a relation (params: schema, table); empty when it does not exist."""
    return sql.SQL(
        "SELECT a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %(schema)s AND c.relname = %(table)s AND a.attnum > 0 "
        "AND NOT a.attisdropped"
    )


def backlog(source: Source, columns: Columns) -> sql.Composed:
    """Unpublished rows and the age of the oldest one, in seconds (for the metrics)."""
    return sql.SQL(
        "SELECT count(*), coalesce(extract(epoch FROM now() - min({created_at})), 0)::float8 "
        "FROM {table} WHERE {unpublished}"
    ).format(
        created_at=sql.Identifier(columns.created_at),
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


def roles_that_can_insert() -> sql.SQL:
    """Non-superuser login roles that may INSERT into the table (params: qualified name).

    Superusers bypass privileges, so no revocation can stop them; the gate ignores them and
    docs/relay.md says so (an application must not write its outbox as a superuser).
    """
    return sql.SQL(
        "SELECT rolname FROM pg_roles WHERE rolcanlogin AND NOT rolsuper "
        "AND has_table_privilege(oid, %(relation)s::regclass, 'INSERT') ORDER BY rolname"
    )


def old_app_sessions() -> sql.SQL:
    """Sessions of the outgoing application in this database (param: pattern, a LIKE)."""
    return sql.SQL(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name LIKE %(pattern)s AND pid <> pg_backend_pid()"
    )


def create_dead_letter(schema: str, table: str) -> sql.Composed:
    """Where messages go after the sink refused them `max_attempts` times; nothing is lost."""
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {table} ("
        "source_table text NOT NULL, id int8 NOT NULL, event_type text, message_key text, "
        "payload json NOT NULL, created_at timestamptz NOT NULL, attempts int NOT NULL, "
        "last_error text NOT NULL, dead_at timestamptz NOT NULL DEFAULT now(), "
        "PRIMARY KEY (source_table, id))"
    ).format(table=sql.Identifier(schema, table))


def insert_dead_letter(schema: str, table: str) -> sql.Composed:
    return sql.SQL(
        "INSERT INTO {table} (source_table, id, event_type, message_key, payload, created_at, "
        "attempts, last_error) VALUES (%(source)s, %(id)s, %(event_type)s, %(key)s, "
        "%(payload)s::json, %(created_at)s, %(attempts)s, %(error)s) "
        "ON CONFLICT (source_table, id) DO NOTHING"
    ).format(table=sql.Identifier(schema, table))


def create_attempts(schema: str, table: str) -> sql.Composed:
    """Rejections so far of messages not yet dead-lettered: survives relay restarts, so a
    message that makes the relay crash-loop still reaches the dead-letter table."""
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {table} ("
        "source_table text NOT NULL, id int8 NOT NULL, attempts int NOT NULL, "
        "last_error text NOT NULL, updated_at timestamptz NOT NULL DEFAULT now(), "
        "PRIMARY KEY (source_table, id))"
    ).format(table=sql.Identifier(schema, table))


def count_attempts(schema: str, table: str) -> sql.Composed:
    """Add one rejection per id (params: source, ids int8[], errors text[]); returns each id's
    attempts so far."""
    return sql.SQL(
        "INSERT INTO {table} AS a (source_table, id, attempts, last_error) "
        "SELECT %(source)s, r.id, 1, r.error "
        "FROM unnest(%(ids)s::int8[], %(errors)s::text[]) AS r(id, error) "
        "ON CONFLICT (source_table, id) DO UPDATE SET attempts = a.attempts + 1, "
        "last_error = excluded.last_error, updated_at = now() RETURNING a.id, a.attempts"
    ).format(table=sql.Identifier(schema, table))


def forget_attempts(schema: str, table: str) -> sql.Composed:
    """Drop the counters of ids that were published or dead-lettered (params: source, ids)."""
    return sql.SQL(
        "DELETE FROM {table} WHERE source_table = %(source)s AND id = ANY(%(ids)s::int8[])"
    ).format(table=sql.Identifier(schema, table))


def attempted_ids(schema: str, table: str) -> sql.Composed:
    """Ids with a rejection on record (param: source), read when a relay starts."""
    return sql.SQL("SELECT id FROM {table} WHERE source_table = %(source)s").format(
        table=sql.Identifier(schema, table)
    )
