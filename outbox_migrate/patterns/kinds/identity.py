"""DROP IDENTITY on the old table: a partition may not have an identity column."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind, make_step
from outbox_migrate.patterns.model import Lock, Step, TxMode


@kind("drop-identity")
def drop_identity(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """Only safe once no V1 instance inserts into the old table: V1's INSERTs rely on the
    identity default and would fail on NOT NULL without it. The deploy gate is therefore this
    step's precondition, checked right before it."""
    n = ctx.names
    readd = sql.SQL("ALTER TABLE {} ALTER COLUMN {} ADD GENERATED {} AS IDENTITY").format(
        n.q(n.table), n.id_q, sql.SQL(ctx.identity_generation)
    )
    resync = sql.SQL(
        "SELECT setval(pg_get_serial_sequence({}, {}), coalesce(max({}), 0) + 1, false) FROM {}"
    ).format(n.reg(n.table), sql.Literal(n.spec.id_column), n.id_q, n.q(n.table))
    if n.spec.id_kind == "application":
        # No identity to drop; the step stays for its deploy gate, re-proved under ACCESS
        # EXCLUSIVE (no inserting transaction can be open) right before the swap.
        return make_step(
            ctx,
            "drop-identity",
            summary=f"Gate under lock: no writer inserts into {n.table} any more "
            "(application ids: no identity to drop)",
            statements=(),
            tx=TxMode.TRANSACTION,
            locks=(Lock(n.table, LockMode.ACCESS_EXCLUSIVE),),
            catalog_only=True,
            preconditions=(c.relation_exists(n, n.table), *ctx.deploy_gate(n.table)),
            postcondition=(c.no_identity(n, n.table),),
            reverse=(),
            reverse_note="nothing to undo",
        )
    return make_step(
        ctx,
        "drop-identity",
        summary=f"Drop IDENTITY from {n.table}.{n.spec.id_column} (a partition may not have one)",
        statements=(
            sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP IDENTITY IF EXISTS").format(
                n.q(n.table), n.id_q
            ),
        ),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.table, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(
            c.relation_exists(n, n.table),
            *ctx.deploy_gate(n.table),
            c.new_ids_above_old(n),
        ),
        postcondition=(c.no_identity(n, n.table),),
        reverse=(readd, resync),
        reverse_note="re-add the identity and move it past the table's highest id",
        reverse_preconditions=(c.not_a_partition(n, n.table),),
    )
