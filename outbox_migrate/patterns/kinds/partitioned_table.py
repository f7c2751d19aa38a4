"""Kinds that build the new partitioned outbox: the parent, its two partitions, the index.

All of them create new, empty relations, so their ACCESS EXCLUSIVE locks are on objects no
application uses yet (the parent's lock during CREATE … PARTITION OF is equally harmless
before V2 is deployed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns import marker
from outbox_migrate.patterns.kinds.base import CREATE_TIMEOUT_MS, BuildContext, kind, make_step
from outbox_migrate.patterns.model import Condition, Created, Lock, Step, TxMode
from outbox_migrate.patterns.privileges import (
    EVERY_PRIVILEGE,
    NO_PRIVILEGE,
    RELAY_CLAIM_PRIVILEGES,
    carry_privileges,
)

NULL_BOUND = marker.NULL_BOUND
"""The unpublished partition's bound as steps name it (a flag marker's value stands for NULL)."""
DEFAULT_BOUND = "DEFAULT"


@kind("create-partitioned-table")
def create_partitioned_table(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """`LIKE` the old table so columns, types, defaults, collations, CHECK constraints and
    identity match exactly (ATTACH later demands identical columns and the parent's CHECKs on
    the attached table).

    Database-generated ids: the parent's id becomes an identity of its own whatever the old
    table had (an identity, a serial, a `nextval` default on any sequence). `LIKE … INCLUDING
    DEFAULTS` would otherwise copy a serial's `nextval('outbox_id_seq')`: the new table would
    depend on a sequence the old table owns (dropping the retired table would take it along).
    The identity starts above every id the old table holds or has handed out, plus headroom
    for V1 instances still inserting while V2 rolls out. It is GENERATED ALWAYS only when the
    old id was (`ctx.identity_generation`): a serial or a BY DEFAULT identity accepted an id
    the INSERT supplies, and the new table must too.

    Application-generated ids (uuid, ULID): nothing to move; the application keeps them unique.
    """
    n = ctx.names
    create = sql.SQL(
        "CREATE TABLE {parent} (LIKE {old} INCLUDING DEFAULTS INCLUDING IDENTITY "
        "INCLUDING GENERATED INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMMENTS) "
        "PARTITION BY LIST ({published_at})"
    ).format(parent=n.q(n.parent), old=n.q(n.table), published_at=n.published_at_q)
    statements: tuple[sql.Composed, ...] = (create,)
    summary = f"Create {n.parent} PARTITION BY LIST ({n.spec.published_column})"
    notes = [
        "CHECK constraints of the old table are copied (a row the old table would refuse "
        "must be refused at insert, not when the relay publishes it into the old table).",
    ]
    if n.spec.id_kind == "database":
        own_identity = tuple(
            sql.SQL("ALTER TABLE {} ALTER COLUMN {} {}").format(n.q(n.parent), n.id_q, action)
            for action in (
                sql.SQL("DROP IDENTITY IF EXISTS"),
                sql.SQL("DROP DEFAULT"),
                sql.SQL("ADD GENERATED {} AS IDENTITY").format(sql.SQL(ctx.identity_generation)),
            )
        )
        start = sql.SQL(
            "SELECT setval(seq, greatest((SELECT max({id}) FROM {old}), "
            "pg_sequence_last_value({old_seq}), 0) + {headroom}) "
            "FROM (SELECT pg_get_serial_sequence({parent_reg}, {id_name})::regclass AS seq) s "
            "WHERE seq IS NOT NULL"
        ).format(
            id=n.id_q,
            old=n.q(n.table),
            old_seq=n.id_sequence(n.table),
            headroom=sql.Literal(n.spec.id_headroom),
            parent_reg=n.reg(n.parent),
            id_name=sql.Literal(n.spec.id_column),
        )
        statements += (*own_identity, start)
        summary += (
            f", its own identity starting {n.spec.id_headroom:,} above the old table's highest id"
        )
        notes.insert(
            0,
            "Ids stay unique across both tables in every pattern: sinks and consumers that "
            "de-duplicate by outbox id would otherwise drop new messages reusing old ids.",
        )
    else:
        notes.insert(
            0,
            "Ids come from the application (id_kind = application): no identity and no "
            "headroom; the application must keep them unique across both tables.",
        )
    notes.append(
        f"{n.parent} gets {n.table}'s owner and every table and column grant, in this "
        "transaction: V2 inserts, reads and marks through it with the privileges V1 had."
    )
    before_privileges = statements
    statements += (carry_privileges(n, n.parent, EVERY_PRIVILEGE),)
    step = make_step(
        ctx,
        "create-partitioned-table",
        summary=summary,
        statements=statements,
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
            c.no_row_security(n),
            c.may_give_to_owner(n),
            *_unique_id_needed(ctx, params),
        ),
        postcondition=(c.relation_exists(n, n.parent), c.partitioned_by_list(n)),
        reverse=(sql.SQL("DROP TABLE {}").format(n.q(n.parent)),),
        reverse_note=f"drop {n.parent}; refused once it holds rows",
        reverse_preconditions=(c.no_partitions(n, n.parent), c.relation_empty(n, n.parent)),
        statement_timeout_ms=CREATE_TIMEOUT_MS,
        creates=(Created("relation", n.parent),),
        notes=tuple(notes),
    )
    # Earlier releases created the parent without carrying privileges (and release 0.1 also
    # without CHECKs): a migration they started is adopted, its grants are the operator's.
    former = [replace(step, statements=before_privileges).checksum()]
    if n.spec.id_kind == "database":
        former.insert(0, replace(step, statements=_release_01(ctx)).checksum())
    return replace(step, former_checksums=tuple(former))


def _release_01(ctx: BuildContext) -> tuple[sql.Composed, ...]:
    """The step as release 0.1 ran it: the identity copied as the old table had it, no CHECK
    constraints, the old table's own identity sequence only. Its postcondition is today's, so
    a migration that ran it is adopted by this release (its new identity was started above
    the old ids all the same; CHECKs are reported by `plan`, as ever)."""
    n = ctx.names
    create = sql.SQL(
        "CREATE TABLE {parent} (LIKE {old} INCLUDING DEFAULTS INCLUDING IDENTITY "
        "INCLUDING GENERATED INCLUDING STORAGE INCLUDING COMMENTS) "
        "PARTITION BY LIST ({published_at})"
    ).format(parent=n.q(n.parent), old=n.q(n.table), published_at=n.published_at_q)
    start = sql.SQL(
        "SELECT setval(seq, greatest((SELECT max({id}) FROM {old}), "
        "pg_sequence_last_value(pg_get_serial_sequence({old_reg}, {id_name})::regclass), 0) "
        "+ {headroom}) "
        "FROM (SELECT pg_get_serial_sequence({parent_reg}, {id_name})::regclass AS seq) s "
        "WHERE seq IS NOT NULL"
    ).format(
        id=n.id_q,
        old=n.q(n.table),
        old_reg=n.reg(n.table),
        headroom=sql.Literal(n.spec.id_headroom),
        parent_reg=n.reg(n.parent),
        id_name=sql.Literal(n.spec.id_column),
    )
    return (create, start)


def _unique_id_needed(ctx: BuildContext, params: Mapping[str, Any]) -> tuple[Condition, ...]:
    """HOPER's copy-back skips rows already copied by `ON CONFLICT (id)`, which needs a unique
    index on the old table's id: checked here, in V2, not at copy-back after the swap."""
    if not params.get("require_unique_id"):
        return ()
    return (c.unique_id_index(ctx.names, ctx.names.table),)


def _create_partition(
    ctx: BuildContext,
    kind_name: str,
    relation: str,
    bound: str,
    summary: str,
    privileges: tuple[str, ...],
    undone_by: tuple[str, ...] = (),
) -> Step:
    """CREATE TABLE … PARTITION OF the new parent: an empty table, dropped again on rollback
    only while it still holds no rows. It gets the old table's owner and `privileges` of its
    grants in the same transaction (a partition inherits neither from its parent)."""
    n = ctx.names
    create = sql.SQL("CREATE TABLE {} PARTITION OF {} {}").format(
        n.q(relation),
        n.q(n.parent),
        marker.bound(n.spec) if bound == NULL_BOUND else sql.SQL(bound),
    )
    step = make_step(
        ctx,
        kind_name,
        summary=summary,
        statements=(create, carry_privileges(n, relation, privileges)),
        tx=TxMode.TRANSACTION,
        locks=(
            Lock(n.parent, LockMode.ACCESS_EXCLUSIVE),
            Lock(relation, LockMode.ACCESS_EXCLUSIVE),
        ),
        preconditions=(
            c.relation_exists(n, n.parent),
            c.relation_absent(n, relation),
            *((c.marker_kind(n, n.table),) if bound == NULL_BOUND else ()),
        ),
        postcondition=(c.partition_bound(n, relation, bound),),
        reverse=(sql.SQL("DROP TABLE {}").format(n.q(relation)),),
        reverse_note=f"drop {relation}; refused once it holds rows",
        reverse_preconditions=(c.relation_empty(n, relation),),
        statement_timeout_ms=CREATE_TIMEOUT_MS,
        undone_by=undone_by,
        creates=(Created("relation", relation),),
        notes=(_partition_privileges_note(n.table, privileges),),
    )
    # Earlier releases created the partition without carrying privileges: adopted as done.
    return replace(step, former_checksums=(replace(step, statements=(create,)).checksum(),))


def _partition_privileges_note(old: str, privileges: tuple[str, ...]) -> str:
    if not privileges:
        return (
            f"Owned by {old}'s owner; no grant: the application reaches it only through the "
            "parent, where PostgreSQL checks the parent's privileges."
        )
    return (
        f"Owned by {old}'s owner, with the {' and '.join(privileges)} grants of {old}: the "
        "relay claims from this partition directly (SELECT … FOR UPDATE SKIP LOCKED)."
    )


@kind("create-unpublished-partition")
def create_unpublished_partition(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return _create_partition(
        ctx,
        "create-unpublished-partition",
        n.unpublished,
        NULL_BOUND,
        f"Create {n.unpublished} as the partition {marker.bound_text(n.spec)}",
        RELAY_CLAIM_PRIVILEGES,
    )


@kind("create-unpublished-index")
def create_unpublished_index(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """The relay claims by id from this partition only; the table is still empty, so a plain
    CREATE INDEX in the transaction is instant (no CONCURRENTLY needed)."""
    n = ctx.names
    # Application ids are claimed in `order_column` order (ties broken by id); database ids
    # by id alone.
    keys = [n.spec.id_column]
    if n.spec.id_kind == "application" and n.spec.order_column:
        keys.insert(0, n.spec.order_column)
    return make_step(
        ctx,
        "create-unpublished-index",
        summary=f"Index {n.unpublished} ({', '.join(keys)}) for the relay's claim",
        statements=(
            sql.SQL("CREATE INDEX {} ON {} ({})").format(
                sql.Identifier(n.spec.unpublished_index),
                n.q(n.unpublished),
                sql.SQL(", ").join(map(sql.Identifier, keys)),
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
        creates=(Created("relation", n.spec.unpublished_index),),
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
        NO_PRIVILEGE,
        undone_by=("swap-default",),
    )
