"""The gate sequence: what the deploy gates watch to prove no writer of the old version is left.

The id's own sequence cannot prove it: an INSERT that supplies its id (a snowflake id, a uuid,
an id the application drew itself) never touches it, and a sequence can move with no row
written. So the migration gives the old table a witness no INSERT can bypass: a FOR EACH
STATEMENT AFTER INSERT trigger that calls `nextval` on a small sequence of its own, and takes a
transaction-level *shared* advisory lock. `nextval` is not
transactional, so an insert is seen when its statement ends, committed or not; the advisory
lock is held until the inserting transaction ends, so a gate also sees an insert that is still
uncommitted (`no-new-ticks` and `no-new-ticks-since-sample` in sql/conditions.sql).

HOPIA's copy trigger raises a transaction-local flag (`COPYING_FLAG`) around its INSERT: that
insert is the migration's own, not a writer's, and does not tick. Inserts made by the
application's own triggers (an outbox row written by a trigger on a business table) do tick.
The function is SECURITY DEFINER so application roles need no privilege on the sequence.
Every outbox gets it, whatever its id kind: the writers, not the ids, are what a gate watches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind, make_step
from outbox_migrate.patterns.model import Created, Lock, Step, TxMode
from outbox_migrate.patterns.names import Names
from outbox_migrate.patterns.names import gate_lock_keys as lock_keys

COPYING_FLAG = "outbox_migrate.copying"
"""Transaction-local setting HOPIA's copy trigger raises (application ids) while it inserts a
published row into the old table: that insert is the migration's, not a writer's."""


def _created(n: Names) -> tuple[Created, ...]:
    return (
        Created("relation", n.spec.gate_sequence),
        Created("function", n.spec.gate_function),
        Created("trigger", n.spec.gate_trigger, on=n.table),
    )


def create_sql(n: Names) -> tuple[sql.Composed, ...]:
    key1, key2 = lock_keys(n)
    sequence = sql.Identifier(n.spec.schema, n.spec.gate_sequence)
    function = sql.Identifier(n.spec.schema, n.spec.gate_function)
    return (
        sql.SQL("CREATE SEQUENCE {} AS bigint CACHE 1").format(sequence),
        sql.SQL(
            "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER "
            "SET search_path = pg_catalog AS $om$\n"
            "BEGIN\n"
            "    -- a writer's INSERT (also one made by the application's own triggers), not\n"
            "    -- HOPIA's copy of a published row, which raises this flag around its INSERT\n"
            "    IF coalesce(current_setting({flag}, true), '') <> 'on' THEN\n"
            "        PERFORM nextval({seq_reg}::regclass);\n"
            "        PERFORM pg_advisory_xact_lock_shared({key1}, {key2});\n"
            "    END IF;\n"
            "    RETURN NULL;\n"
            "END\n"
            "$om$"
        ).format(
            function=function,
            flag=sql.Literal(COPYING_FLAG),
            seq_reg=n.reg(n.spec.gate_sequence),
            key1=key1,
            key2=key2,
        ),
        sql.SQL(
            "CREATE TRIGGER {trigger} AFTER INSERT ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
        ).format(
            trigger=sql.Identifier(n.spec.gate_trigger), table=n.q(n.table), function=function
        ),
    )


def drop_sql(n: Names) -> tuple[sql.Composed, ...]:
    return (
        sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(
            sql.Identifier(n.spec.gate_trigger), n.q(n.table)
        ),
        sql.SQL("DROP FUNCTION IF EXISTS {}()").format(
            sql.Identifier(n.spec.schema, n.spec.gate_function)
        ),
        sql.SQL("DROP SEQUENCE IF EXISTS {}").format(
            sql.Identifier(n.spec.schema, n.spec.gate_sequence)
        ),
    )


@kind("install-gate-sequence")
def install_gate_sequence(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return make_step(
        ctx,
        "install-gate-sequence",
        summary=f"Sequence {n.spec.gate_sequence} ticked by every INSERT statement into "
        f"{n.table}: what the deploy gates watch (ids supplied or generated alike)",
        statements=create_sql(n),
        tx=TxMode.TRANSACTION,
        # CREATE TRIGGER takes SHARE ROW EXCLUSIVE: it waits for the inserts in flight, so
        # every insert after it ticks.
        locks=(Lock(n.table, LockMode.SHARE_ROW_EXCLUSIVE),),
        catalog_only=True,
        # V2's last step: whatever refuses the migration (its creating steps' checks) has
        # refused before the old table gets a trigger; the gates come later, in V3 or V4.
        preconditions=(
            c.relation_exists(n, n.table),
            c.relation_absent(n, n.spec.gate_sequence),
        ),
        postcondition=(c.relation_exists(n, n.spec.gate_sequence),),
        reverse=drop_sql(n),
        reverse_note="drop the trigger, its function and the sequence",
        undone_by=("remove-gate-sequence",),
        creates=_created(n),
        notes=(
            "nextval is not transactional and the trigger also holds a shared advisory lock "
            "until the inserting transaction ends: a gate sees an uncommitted insert too.",
        ),
    )


@kind("remove-gate-sequence")
def remove_gate_sequence(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return make_step(
        ctx,
        "remove-gate-sequence",
        summary=f"Drop the gate trigger and {n.spec.gate_sequence}: the last deploy gate passed",
        statements=drop_sql(n),
        tx=TxMode.TRANSACTION,
        # DROP TRIGGER takes ACCESS EXCLUSIVE (CREATE TRIGGER only SHARE ROW EXCLUSIVE)
        locks=(Lock(n.table, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(c.relation_exists(n, n.table),),
        postcondition=(c.relation_absent(n, n.spec.gate_sequence),),
        reverse=create_sql(n),
        reverse_note="re-create the sequence, its function and the trigger",
        reverse_creates=_created(n),
        reverse_preconditions=(c.relation_absent(n, n.spec.gate_sequence),),
    )
