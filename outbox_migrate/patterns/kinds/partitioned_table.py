"""Kinds that build the new partitioned outbox: the parent, its two partitions, the index, and
what is set on them where they are created (the wake-up trigger, autovacuum tuning). Their
ACCESS EXCLUSIVE locks fall on new, empty relations no application uses before V2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.config import DEFAULT_CHANNEL
from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns import marker, notify
from outbox_migrate.patterns.kinds.base import BuildContext, kind
from outbox_migrate.patterns.model import CREATE_TIMEOUT_MS, Created, Lock, Step
from outbox_migrate.patterns.names import Names
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
    the attached table). Ids: docs/patterns.md, "Why ids start above the old maximum"."""
    n = ctx.names
    statements: tuple[sql.Composed, ...] = (_create_parent_sql(n),)
    summary = f"Create {n.parent} PARTITION BY LIST ({n.spec.published_column})"
    ids_note = (
        "Ids come from the application (id_kind = application): no identity and no "
        "headroom; the application must keep them unique across both tables."
    )
    # Earlier releases created the parent without carrying privileges (and release 0.1 also
    # without CHECKs): a migration they started is adopted, its grants are the operator's.
    formerly: list[tuple[sql.Composed, ...]] = []
    if n.spec.id_kind == "database":
        # An identity of its own, not the copied `nextval('outbox_id_seq')` default: the new
        # table must not depend on a sequence the old table owns (dropping the old table would
        # take it along).
        own_identity = tuple(
            sql.SQL("ALTER TABLE {} ALTER COLUMN {} {}").format(n.q(n.parent), n.id_q, action)
            for action in (
                sql.SQL("DROP IDENTITY IF EXISTS"),
                sql.SQL("DROP DEFAULT"),
                sql.SQL("ADD GENERATED {} AS IDENTITY").format(
                    sql.SQL(ctx.options.identity_generation)
                ),
            )
        )
        statements += (*own_identity, _start_identity_sql(n, n.id_sequence(n.table)))
        # Release 0.1: the identity copied as the old table had it, no CHECK constraints,
        # the old table's own identity sequence only. Its postcondition is today's, so a
        # migration that ran it is adopted (its new identity was started above the old ids
        # all the same; CHECKs are reported by `plan`, as ever).
        old_seq = sql.SQL("pg_get_serial_sequence({}, {})::regclass").format(
            n.reg(n.table), sql.Literal(n.spec.id_column)
        )
        formerly.append((_create_parent_sql(n, checks=False), _start_identity_sql(n, old_seq)))
        summary += (
            f", its own identity starting {n.spec.id_headroom:,} above the old table's highest id"
        )
        ids_note = (
            "Ids stay unique across both tables in every pattern: sinks and consumers that "
            "de-duplicate by outbox id would otherwise drop new messages reusing old ids."
        )
    formerly.append(statements)
    return Step(
        **ctx.place("create-partitioned-table"),
        summary=summary,
        statements=(*statements, carry_privileges(n, n.parent, EVERY_PRIVILEGE)),
        locks=(
            Lock(n.table, LockMode.ACCESS_SHARE),
            Lock(n.parent, LockMode.ACCESS_EXCLUSIVE),
        ),
        preconditions=(
            c.relation_exists(n, n.table),
            c.is_plain_table(n, n.table),
            c.no_fk_references(n, n.table),
            c.relation_absent(n, n.parent),
            c.condition(
                "no-row-security", n.table, rel_reg=n.reg(n.table), parent_reg=n.reg(n.parent)
            ),
            c.condition("may-give-to-owner", n.table, rel_reg=n.reg(n.table)),
            # HOPER's copy-back skips rows already copied by `ON CONFLICT (id)`, which needs
            # a unique index on the old table's id: checked here, in V2, not at copy-back
            # after the swap.
            *((c.unique_id_index(n, n.table),) if params.get("require_unique_id") else ()),
        ),
        postcondition=(c.relation_exists(n, n.parent), c.partitioned_by_list(n)),
        reverse=(sql.SQL("DROP TABLE {}").format(n.q(n.parent)),),
        reverse_note=f"drop {n.parent}; refused once it holds rows",
        reverse_preconditions=(c.no_partitions(n, n.parent), c.relation_empty(n, n.parent)),
        statement_timeout_ms=CREATE_TIMEOUT_MS,
        creates=(Created("relation", n.parent),),
        notes=(
            ids_note,
            "CHECK constraints of the old table are copied (a row the old table would refuse "
            "must be refused at insert, not when the relay publishes it into the old table).",
            f"{n.parent} gets {n.table}'s owner and every table and column grant, in this "
            "transaction: V2 inserts, reads and marks through it with the privileges V1 had.",
        ),
        formerly=tuple(formerly),
    )


def _create_parent_sql(n: Names, *, checks: bool = True) -> sql.Composed:
    """`checks=False`: release 0.1's, which did not copy the CHECK constraints."""
    return sql.SQL(
        "CREATE TABLE {parent} (LIKE {old} INCLUDING DEFAULTS INCLUDING IDENTITY "
        "INCLUDING GENERATED {constraints}INCLUDING STORAGE INCLUDING COMMENTS) "
        "PARTITION BY LIST ({published_at})"
    ).format(
        parent=n.q(n.parent),
        old=n.q(n.table),
        constraints=sql.SQL("INCLUDING CONSTRAINTS " if checks else ""),
        published_at=n.published_at_q,
    )


def _start_identity_sql(n: Names, old_seq: sql.Composable) -> sql.Composed:
    """Start the parent's identity above every id the old table holds or its sequence
    `old_seq` has handed out, plus the headroom."""
    return sql.SQL(
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
    return Step(
        **ctx.place(kind_name),
        summary=summary,
        statements=(create, carry_privileges(n, relation, privileges)),
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
        notes=(
            f"Owned by {n.table}'s owner, with the {' and '.join(privileges)} grants of "
            f"{n.table}: the relay claims from this partition directly (SELECT … FOR UPDATE "
            "SKIP LOCKED)."
            if privileges
            else f"Owned by {n.table}'s owner; no grant: the application reaches it only "
            "through the parent, where PostgreSQL checks the parent's privileges.",
        ),
        # Earlier releases created the partition without carrying privileges: adopted as done.
        formerly=((create,),),
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
    return Step(
        **ctx.place("create-unpublished-index"),
        summary=f"Index {n.unpublished} ({', '.join(keys)}) for the relay's claim",
        statements=(
            sql.SQL("CREATE INDEX {} ON {} ({})").format(
                sql.Identifier(n.spec.unpublished_index),
                n.q(n.unpublished),
                sql.SQL(", ").join(map(sql.Identifier, keys)),
            ),
        ),
        locks=(Lock(n.unpublished, LockMode.SHARE),),
        preconditions=(
            c.partition_bound(n, n.unpublished, NULL_BOUND),
            c.relation_absent(n, n.spec.unpublished_index),
        ),
        postcondition=(c.unpublished_index_exists(n),),
        reverse=(sql.SQL("DROP INDEX {}").format(n.q(n.spec.unpublished_index)),),
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


@kind("install-notify-trigger")
def install_notify_trigger(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """Installed where the partitioned table is created, so that phase's relay wakes on new
    rows. Statement-level triggers are not cloned to partitions and a cross-partition UPDATE
    (the relay's mark) does not fire them."""
    n = ctx.names
    channel = str(params.get("channel", DEFAULT_CHANNEL))
    return Step(
        **ctx.place("install-notify-trigger"),
        summary=f"Statement-level AFTER INSERT trigger on {n.parent} waking an idle relay",
        statements=notify.create_sql(n.spec, channel),
        locks=(Lock(n.parent, LockMode.SHARE_ROW_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(c.partitioned_by_list(n),),
        postcondition=(c.on_trigger("trigger-exists", n, n.parent, notify.TRIGGER_NAME, "notify"),),
        reverse=notify.drop_sql(n.spec),
        reverse_note="drop the wake-up trigger and its function (the relay falls back to polling)",
        creates=(
            Created("function", notify.function_name(n.spec)),
            Created("trigger", notify.TRIGGER_NAME, on=n.parent),
        ),
    )


@kind("tune-autovacuum")
def tune_autovacuum(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """`AUTOVACUUM_INSERT_ONLY` on the published partition, or the old table once it takes
    that role."""
    n = ctx.names
    target = str(params.get("target", "published"))
    if target not in ("published", "old"):
        raise ValueError("tune-autovacuum target must be one of ['old', 'published']")
    relation = n.published if target == "published" else n.table
    settings = sql.SQL(", ").join(
        sql.SQL("{} = {}").format(sql.SQL(key), sql.Literal(int(value)))
        for key, value in c.AUTOVACUUM_INSERT_ONLY
    )
    keys = sql.SQL(", ").join(sql.SQL(key) for key, _ in c.AUTOVACUUM_INSERT_ONLY)
    return Step(
        **ctx.place("tune-autovacuum" if target == "published" else "tune-autovacuum-old"),
        summary=f"Insert-only autovacuum settings on {relation} (every 100 k inserts)",
        statements=(sql.SQL("ALTER TABLE {} SET ({})").format(n.q(relation), settings),),
        locks=(Lock(relation, LockMode.SHARE_UPDATE_EXCLUSIVE),),
        preconditions=(c.relation_exists(n, relation),),
        postcondition=(c.autovacuum_tuned(n, relation),),
        reverse=(sql.SQL("ALTER TABLE {} RESET ({})").format(n.q(relation), keys),),
        reverse_note="reset the four settings to the server defaults",
        # The published partition is detached by the swap and may be dropped afterwards.
        undone_by=("swap-default",) if target == "published" else (),
    )
