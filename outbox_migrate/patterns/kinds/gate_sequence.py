"""The gate sequence: what the deploy gates watch to prove no writer of the old version is left
(never the id's own sequence, which an INSERT that supplies its id does not touch); and the
gates themselves (docs/patterns.md, "What the deploy gates watch").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind
from outbox_migrate.patterns.kinds.original_name import unseal_sql
from outbox_migrate.patterns.model import Condition, Created, Lock, Step, TxMode
from outbox_migrate.patterns.names import Names
from outbox_migrate.patterns.names import gate_lock_keys as lock_keys

COPYING_FLAG = "outbox_migrate.copying"
"""Transaction-local setting HOPIA's copy trigger raises (application ids) while it inserts a
published row into the old table: that insert is the migration's, not a writer's."""


def _created(n: Names) -> tuple[Created, ...]:
    return (
        Created("relation", n.spec.gate_sequence),
        Created("function", n.spec.gate_tick),
        Created("trigger", n.spec.gate_tick, on=n.table),
    )


def create_sql(n: Names) -> tuple[sql.Composed, ...]:
    key1, key2 = lock_keys(n)
    sequence = n.q(n.spec.gate_sequence)
    function = n.q(n.spec.gate_tick)
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
        ).format(trigger=sql.Identifier(n.spec.gate_tick), table=n.q(n.table), function=function),
    )


def drop_sql(n: Names) -> tuple[sql.Composed, ...]:
    return (
        sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(
            sql.Identifier(n.spec.gate_tick), n.q(n.table)
        ),
        sql.SQL("DROP FUNCTION IF EXISTS {}()").format(n.q(n.spec.gate_tick)),
        sql.SQL("DROP SEQUENCE IF EXISTS {}").format(n.q(n.spec.gate_sequence)),
    )


@kind("install-gate-sequence")
def install_gate_sequence(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return Step(
        **ctx.place("install-gate-sequence"),
        summary=f"Sequence {n.spec.gate_sequence} ticked by every INSERT statement into "
        f"{n.table}: what the deploy gates watch (ids supplied or generated alike)",
        statements=create_sql(n),
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
    return Step(
        **ctx.place("remove-gate-sequence"),
        summary=f"Drop the gate trigger and {n.spec.gate_sequence}: the last deploy gate passed",
        statements=drop_sql(n),
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


@kind("gate-old-table-retired")
def gate_old_table_retired(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """A deploy gate: no SQL; its preconditions stop a premature `run --to V3` (a V1 writer
    left, unpublished rows in the old table, or sessions of the outgoing version)."""
    n = ctx.names
    # `unseal` (COP, HOP): going back before V3 the old version may insert into the flat
    # table again, so the seal the rename to the original name left on it goes.
    unseal = bool(params.get("unseal", False))
    return Step(
        **ctx.place("gate-old-table-retired"),
        summary=f"Gate: no writer inserts into {n.table} any more and it is fully published",
        statements=(),
        tx=TxMode.NONE,
        locks=(),
        preconditions=(
            c.relation_exists(n, n.table),
            *ctx.deploy_gate(n.table),
            c.drained(n, n.table, ctx.phase),
        ),
        postcondition=(),
        reverse=(unseal_sql(n),) if unseal else (),
        reverse_note="nothing to undo (but the original-name phase's seal, if any)"
        if unseal
        else "nothing to undo",
        statement_timeout_ms=None,
    )


@kind("drop-identity")
def drop_identity(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """Only safe once no V1 instance inserts into the old table (its INSERTs rely on the
    identity default): the deploy gate is this step's precondition."""
    n = ctx.names
    gated: tuple[Condition, ...] = (c.relation_exists(n, n.table), *ctx.deploy_gate(n.table))
    if n.spec.id_kind == "application":
        # No identity to drop; the step stays for its deploy gate, re-proved under ACCESS
        # EXCLUSIVE (no inserting transaction can be open) right before the swap.
        return Step(
            **ctx.place("drop-identity"),
            summary=f"Gate under lock: no writer inserts into {n.table} any more "
            "(application ids: no identity to drop)",
            statements=(),
            locks=(Lock(n.table, LockMode.ACCESS_EXCLUSIVE),),
            catalog_only=True,
            preconditions=gated,
            postcondition=(c.no_identity(n, n.table),),
            reverse=(),
            reverse_note="nothing to undo",
        )
    readd = sql.SQL("ALTER TABLE {} ALTER COLUMN {} ADD GENERATED {} AS IDENTITY").format(
        n.q(n.table), n.id_q, sql.SQL(ctx.options.identity_generation)
    )
    resync = sql.SQL(
        "SELECT setval(pg_get_serial_sequence({}, {}), coalesce(max({}), 0) + 1, false) FROM {}"
    ).format(n.reg(n.table), sql.Literal(n.spec.id_column), n.id_q, n.q(n.table))
    return Step(
        **ctx.place("drop-identity"),
        summary=f"Drop IDENTITY from {n.table}.{n.spec.id_column} (a partition may not have one)",
        statements=(
            sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP IDENTITY IF EXISTS").format(
                n.q(n.table), n.id_q
            ),
        ),
        locks=(Lock(n.table, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(*gated, c.new_ids_above_old(n)),
        postcondition=(c.no_identity(n, n.table),),
        reverse=(readd, resync),
        reverse_note="re-add the identity and move it past the table's highest id",
        reverse_preconditions=(c.not_a_partition(n, n.table),),
    )
