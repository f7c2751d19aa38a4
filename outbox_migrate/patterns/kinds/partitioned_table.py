"""Kinds that build the new partitioned outbox: the parent, its two partitions, the index.

All of them create new, empty relations, so their ACCESS EXCLUSIVE locks are on objects no
application uses yet (the parent's lock during CREATE … PARTITION OF is equally harmless
before V2 is deployed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds import CREATE_TIMEOUT_MS, BuildContext, kind, make_step
from outbox_migrate.patterns.model import Lock, LockMode, Step, TxMode

NULL_BOUND = "FOR VALUES IN (NULL)"
DEFAULT_BOUND = "DEFAULT"


@kind("create-partitioned-table")
def create_partitioned_table(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """`LIKE` the old table so columns, types, defaults, collations and identity match exactly
    (ATTACH later demands identical columns), then move the identity's next value above every
    id the old table holds or has handed out, plus headroom for V1 instances still inserting
    while V2 rolls out."""
    n = ctx.names
    old_seq = sql.SQL("pg_get_serial_sequence({}, {})::regclass").format(
        n.reg(n.table), sql.Literal(n.spec.id_column)
    )
    create = sql.SQL(
        "CREATE TABLE {parent} (LIKE {old} INCLUDING DEFAULTS INCLUDING IDENTITY "
        "INCLUDING GENERATED INCLUDING STORAGE INCLUDING COMMENTS) "
        "PARTITION BY LIST ({published_at})"
    ).format(parent=n.q(n.parent), old=n.q(n.table), published_at=n.published_at_q)
    start = sql.SQL(
        "SELECT setval(seq, greatest((SELECT max({id}) FROM {old}), "
        "pg_sequence_last_value({old_seq}), 0) + {headroom}) "
        "FROM (SELECT pg_get_serial_sequence({parent_reg}, {id_name})::regclass AS seq) s "
        "WHERE seq IS NOT NULL"
    ).format(
        id=n.id_q,
        old=n.q(n.table),
        old_seq=old_seq,
        headroom=sql.Literal(n.spec.id_headroom),
        parent_reg=n.reg(n.parent),
        id_name=sql.Literal(n.spec.id_column),
    )
    return make_step(
        ctx,
        "create-partitioned-table",
        summary=f"Create {n.parent} PARTITION BY LIST ({n.spec.published_column}), identity "
        f"starting {n.spec.id_headroom:,} above the old table's highest id",
        statements=(create, start),
        tx=TxMode.TRANSACTION,
        locks=(
            Lock(n.table, LockMode.ACCESS_SHARE),
            Lock(n.parent, LockMode.ACCESS_EXCLUSIVE),
        ),
        preconditions=(
            c.relation_exists(n, n.table),
            c.is_plain_table(n, n.table),
            c.no_fk_references(n, n.table),
            c.relation_absent(n, n.parent),
        ),
        postcondition=(c.relation_exists(n, n.parent), c.partitioned_by_list(n)),
        reverse=(sql.SQL("DROP TABLE {}").format(n.q(n.parent)),),
        reverse_note=f"drop {n.parent}; refused once it holds rows",
        reverse_preconditions=(c.relation_empty(n, n.parent),),
        statement_timeout_ms=CREATE_TIMEOUT_MS,
        notes=(
            "Ids stay unique across both tables in every pattern: sinks and consumers that "
            "de-duplicate by outbox id would otherwise drop new messages reusing old ids.",
        ),
    )


def _create_partition(
    ctx: BuildContext,
    kind_name: str,
    relation: str,
    bound: str,
    summary: str,
    undone_by: tuple[str, ...] = (),
) -> Step:
    """CREATE TABLE … PARTITION OF the new parent: an empty table, dropped again on rollback
    only while it still holds no rows."""
    n = ctx.names
    return make_step(
        ctx,
        kind_name,
        summary=summary,
        statements=(
            sql.SQL("CREATE TABLE {} PARTITION OF {} {}").format(
                n.q(relation), n.q(n.parent), sql.SQL(bound)
            ),
        ),
        tx=TxMode.TRANSACTION,
        locks=(
            Lock(n.parent, LockMode.ACCESS_EXCLUSIVE),
            Lock(relation, LockMode.ACCESS_EXCLUSIVE),
        ),
        preconditions=(c.relation_exists(n, n.parent), c.relation_absent(n, relation)),
        postcondition=(c.partition_bound(n, relation, bound),),
        reverse=(sql.SQL("DROP TABLE {}").format(n.q(relation)),),
        reverse_note=f"drop {relation}; refused once it holds rows",
        reverse_preconditions=(c.relation_empty(n, relation),),
        statement_timeout_ms=CREATE_TIMEOUT_MS,
        undone_by=undone_by,
    )


@kind("create-unpublished-partition")
def create_unpublished_partition(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return _create_partition(
        ctx,
        "create-unpublished-partition",
        n.unpublished,
        NULL_BOUND,
        f"Create {n.unpublished} as the partition FOR VALUES IN (NULL)",
    )


@kind("create-unpublished-index")
def create_unpublished_index(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """The relay claims by id from this partition only; the table is still empty, so a plain
    CREATE INDEX in the transaction is instant (no CONCURRENTLY needed)."""
    n = ctx.names
    return make_step(
        ctx,
        "create-unpublished-index",
        summary=f"Index {n.unpublished} ({n.spec.id_column}) for the relay's claim",
        statements=(
            sql.SQL("CREATE INDEX {} ON {} ({})").format(
                sql.Identifier(n.spec.unpublished_index), n.q(n.unpublished), n.id_q
            ),
        ),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.unpublished, LockMode.SHARE),),
        preconditions=(
            c.partition_bound(n, n.unpublished, NULL_BOUND),
            c.relation_absent(n, n.spec.unpublished_index),
        ),
        postcondition=(c.unpublished_index_exists(n),),
        reverse=(sql.SQL("DROP INDEX {}").format(n.index_q),),
        reverse_note="drop the index",
        statement_timeout_ms=CREATE_TIMEOUT_MS,
    )


@kind("create-published-partition")
def create_published_partition(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return _create_partition(
        ctx,
        "create-published-partition",
        n.published,
        DEFAULT_BOUND,
        f"Create {n.published} as the DEFAULT partition (every published row)",
        undone_by=("swap-default",),
    )
