"""HOPIA's copy trigger: every row that lands in the published partition is also written to
the old table, so the old table (the future DEFAULT partition) is complete at all times.

Rows reach the published partition by the relay's cross-partition UPDATE, which PostgreSQL
executes as DELETE from `outbox_unpublished` + INSERT into `outbox_published`; the INSERT fires
row-level AFTER INSERT triggers on the destination partition.

The spec's trigger inserts explicit ids; while the old table still has its identity (until
V4) that needs `OVERRIDING SYSTEM VALUE`, otherwise GENERATED ALWAYS rejects the insert and the
relay's UPDATE fails. `ON CONFLICT DO NOTHING` keeps the copy idempotent.

The function is SECURITY DEFINER (search_path pinned): the trigger fires in the relay's
session, and the relay's role has had INSERT on the old table revoked for the switch gate, so
the copy runs with the rights of the role that installed it (the table's owner, as the runner
asks), not the relay's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind, make_step
from outbox_migrate.patterns.kinds.partitioned_table import DEFAULT_BOUND
from outbox_migrate.patterns.model import Created, Lock, Step, TxMode
from outbox_migrate.patterns.names import Names


def definer_rights(n: Names) -> sql.Composed:
    """Copy with the installer's rights, not the relay's (see the module docstring). The
    search_path is pinned (pg_catalog first, so a caller cannot shadow a built-in) and ends
    with the outbox's schema, where the old table's own triggers, which fire inside the copy,
    found their unqualified names before."""
    return sql.SQL("SECURITY DEFINER SET search_path = pg_catalog, {} ").format(
        sql.Identifier(n.spec.schema)
    )


def create_trigger_sql(
    ctx: BuildContext, security: sql.Composable | None = None, *, flagged: bool = True
) -> tuple[sql.Composed, ...]:
    """`flagged=False` only rebuilds what earlier releases installed for database ids, to
    adopt it (their gates did not read the gate sequence)."""
    n = ctx.names
    if security is None:
        security = definer_rights(n)
    # The gate sequence's trigger on the old table must not count this copy as a writer
    # (kinds/gate_sequence.py): the flag is raised around the INSERT only.
    from outbox_migrate.patterns.kinds.gate_sequence import COPYING_FLAG

    if not flagged:
        return (
            sql.SQL(
                "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql "
                "{security}AS $om$\n"
                "BEGIN\n"
                "    INSERT INTO {old} OVERRIDING SYSTEM VALUE VALUES (NEW.*) "
                "ON CONFLICT DO NOTHING;\n"
                "    RETURN NULL;\n"
                "END\n"
                "$om$"
            ).format(function=n.function_q, old=n.q(n.table), security=security),
            _trigger(ctx),
        )
    function = sql.SQL(
        "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql "
        "{security}AS $om$\n"
        "BEGIN\n"
        "    PERFORM set_config({flag}, 'on', true);\n"
        "    INSERT INTO {old} OVERRIDING SYSTEM VALUE VALUES (NEW.*) ON CONFLICT DO NOTHING;\n"
        "    PERFORM set_config({flag}, 'off', true);\n"
        "    RETURN NULL;\n"
        "END\n"
        "$om$"
    ).format(
        function=n.function_q, old=n.q(n.table), flag=sql.Literal(COPYING_FLAG), security=security
    )
    return (function, _trigger(ctx))


def _trigger(ctx: BuildContext) -> sql.Composed:
    n = ctx.names
    return sql.SQL(
        "CREATE TRIGGER {trigger} AFTER INSERT ON {published} "
        "FOR EACH ROW EXECUTE FUNCTION {function}()"
    ).format(trigger=n.trigger_q, published=n.q(n.published), function=n.function_q)


def drop_trigger_sql(ctx: BuildContext) -> tuple[sql.Composed, ...]:
    n = ctx.names
    return (
        sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(n.trigger_q, n.q(n.published)),
        sql.SQL("DROP FUNCTION IF EXISTS {}()").format(n.function_q),
    )


@kind("install-copy-trigger")
def install_copy_trigger(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    step = make_step(
        ctx,
        "install-copy-trigger",
        summary=f"AFTER INSERT trigger on {n.published} copying each published row to {n.table}",
        statements=create_trigger_sql(ctx),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.published, LockMode.SHARE_ROW_EXCLUSIVE),),
        preconditions=(
            c.partition_bound(n, n.published, DEFAULT_BOUND),
            c.relation_exists(n, n.table),
            c.relation_empty(n, n.published),
        ),
        postcondition=(c.trigger_exists(n),),
        reverse=drop_trigger_sql(ctx),
        reverse_note="drop the trigger and its function",
        undone_by=("remove-copy-trigger",),
        creates=(
            Created("function", n.spec.copy_function),
            Created("trigger", n.spec.copy_trigger, on=n.published),
        ),
    )
    # Earlier releases installed the function with the invoker's rights, and for database
    # ids without the copying flag: adopted as done.
    earlier = [create_trigger_sql(ctx, security=sql.SQL(""))]
    if n.spec.id_kind != "application":
        earlier += [
            create_trigger_sql(ctx, flagged=False),
            create_trigger_sql(ctx, security=sql.SQL(""), flagged=False),
        ]
    former = tuple(replace(step, statements=e).checksum() for e in earlier)
    return replace(step, former_checksums=former)


@kind("remove-copy-trigger")
def remove_copy_trigger(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return make_step(
        ctx,
        "remove-copy-trigger",
        summary=f"Drop the copy trigger and its function ({n.published} is detached now)",
        statements=drop_trigger_sql(ctx),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.published, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(c.not_a_partition(n, n.published),),
        postcondition=(c.trigger_absent(n), c.function_absent(n)),
        reverse=create_trigger_sql(ctx),
        reverse_note="re-create the trigger and function",
        reverse_creates=(
            Created("function", n.spec.copy_function),
            Created("trigger", n.spec.copy_trigger, on=n.published),
        ),
        reverse_preconditions=(c.relation_exists(n, n.published),),
    )


@kind("drop-detached-published")
def drop_detached_published(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return make_step(
        ctx,
        "drop-detached-published",
        summary=f"Drop the detached {n.published}: every row of it is in {n.table}",
        statements=(sql.SQL("DROP TABLE {}").format(n.q(n.published)),),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.published, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(
            c.not_a_partition(n, n.published),
            c.all_rows_present(n, n.published, n.table),
        ),
        postcondition=(c.relation_absent(n, n.published),),
        reverse=None,
        reverse_note="irreversible: the table is gone (its rows live on in the old table)",
        optional=bool(params.get("optional", False)),
    )
