"""The CHECK (published_at IS NOT NULL) sequence that lets ATTACH skip its scan (for a flag
marker: CHECK (published IS NOT NULL AND published <> 0), see patterns/marker.py).

NOT VALID first (a catalog change under a brief ACCESS EXCLUSIVE), VALIDATE in its own
transaction (scans, but under SHARE UPDATE EXCLUSIVE, which blocks neither reads nor writes),
optionally SET NOT NULL (PostgreSQL 12+ proves it from the validated CHECK without a scan), and
after the attach DROP CONSTRAINT, since the partition constraint now says the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns import marker
from outbox_migrate.patterns.kinds.base import (
    SCAN_GUARD_TIMEOUT_MS,
    BuildContext,
    kind,
    make_step,
)
from outbox_migrate.patterns.kinds.partitioned_table import DEFAULT_BOUND
from outbox_migrate.patterns.model import Created, Lock, Step, TxMode


def add_check_sql(ctx: BuildContext) -> sql.Composed:
    n = ctx.names
    return sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} CHECK ({}) NOT VALID").format(
        n.q(n.table), n.check_q, marker.published(n.spec)
    )


def drop_check_sql(ctx: BuildContext) -> sql.Composed:
    n = ctx.names
    return sql.SQL("ALTER TABLE {} DROP CONSTRAINT IF EXISTS {}").format(n.q(n.table), n.check_q)


@kind("add-not-valid-check")
def add_not_valid_check(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """New rows are checked at once, so every writer of unpublished rows into the old table
    must be gone and the table drained before this runs."""
    n = ctx.names
    return make_step(
        ctx,
        "add-not-valid-check",
        summary=f"Add CHECK ({marker.describe_published(n.spec)}) NOT VALID to {n.table}",
        statements=(add_check_sql(ctx),),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.table, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(*ctx.deploy_gate(n.table), c.drained(n, n.table, ctx.phase)),
        postcondition=(c.check_exists(n),),
        reverse=(drop_check_sql(ctx),),
        reverse_note="drop the constraint",
        undone_by=("drop-check",),
        creates=(Created("constraint", n.spec.check_name, on=n.table),),
    )


@kind("validate-check")
def validate_check(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return make_step(
        ctx,
        "validate-check",
        summary=f"VALIDATE the CHECK on {n.table} in its own transaction",
        statements=(
            sql.SQL("ALTER TABLE {} VALIDATE CONSTRAINT {}").format(n.q(n.table), n.check_q),
        ),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.table, LockMode.SHARE_UPDATE_EXCLUSIVE),),
        scan=f"reads all of {n.table} under SHARE UPDATE EXCLUSIVE (reads and writes go on)",
        statement_timeout_ms=None,
        preconditions=(c.check_exists(n), c.drained(n, n.table, ctx.phase)),
        postcondition=(c.check_exists(n), c.check_validated(n)),
        reverse=(),
        reverse_note="nothing to undo (reversing the add step drops the constraint)",
        undone_by=("drop-check",),
    )


@kind("set-not-null")
def set_not_null(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    col = n.spec.published_column
    return make_step(
        ctx,
        "set-not-null",
        summary=f"Optional: SET NOT NULL on {n.table}.{col}, proven by the validated CHECK",
        statements=(
            sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET NOT NULL").format(
                n.q(n.table), n.published_at_q
            ),
        ),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.table, LockMode.ACCESS_EXCLUSIVE),),
        scan="none: the validated CHECK proves it (a scan would hit the statement_timeout)",
        catalog_only=True,
        statement_timeout_ms=SCAN_GUARD_TIMEOUT_MS,
        preconditions=(c.check_exists(n), c.check_validated(n)),
        postcondition=(c.column_not_null(n),),
        reverse=(
            sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP NOT NULL").format(
                n.q(n.table), n.published_at_q
            ),
        ),
        reverse_note="drop the NOT NULL",
        optional=True,
    )


@kind("drop-check")
def drop_check(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return make_step(
        ctx,
        "drop-check",
        summary=f"Drop the now-redundant CHECK from {n.table} (the partition bound says it)",
        statements=(drop_check_sql(ctx),),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.table, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(c.partition_bound(n, n.table, DEFAULT_BOUND),),
        postcondition=(c.check_absent(n),),
        reverse=(add_check_sql(ctx),),
        reverse_note="re-add the CHECK as NOT VALID (catalog-only)",
        reverse_creates=(Created("constraint", n.spec.check_name, on=n.table),),
    )
