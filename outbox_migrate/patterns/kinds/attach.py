"""Making the old table the DEFAULT partition: COPRA's attach and HOPER/HOPIA's swap.

ATTACH validates that every row of the attached table satisfies the partition constraint
(for the DEFAULT partition here: `published_at IS NOT NULL`; for a flag marker
`NOT (published IS NOT NULL AND published = 0)`) while holding ACCESS EXCLUSIVE on
it — a full scan — unless a *validated* CHECK already implies that constraint. The scan guard
(these steps' preconditions) proves the CHECK exists, is validated and implies the bound, that
the columns match and that no identity is left; the statement then runs under a tight
statement_timeout so that a scan PostgreSQL decided on anyway fails in a second.

DETACH … CONCURRENTLY is refused whenever the parent has a DEFAULT partition, so the swap uses
a plain DETACH, which takes ACCESS EXCLUSIVE on the parent: it must be, and is, catalog-only.
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
from outbox_migrate.patterns.model import Condition, Lock, Step, TxMode


def scan_guard(ctx: BuildContext) -> tuple[Condition, ...]:
    n = ctx.names
    # Application ids have no identity that could collide with the old ids: nothing to check.
    ids_above = () if n.spec.id_kind == "application" else (c.new_ids_above_old(n),)
    return (
        c.relation_exists(n, n.parent),
        c.is_plain_table(n, n.table),
        c.check_exists(n),
        c.check_validated(n),
        c.check_implies_partition_constraint(n),
        c.columns_match(n, n.table),
        c.no_identity(n, n.table),
        c.no_fk_references(n, n.table),
        c.no_trigger_name_clash(n),
        *ids_above,
        c.drained(n, n.table, ctx.phase),
    )


def attach_old_sql(ctx: BuildContext) -> sql.Composed:
    n = ctx.names
    return sql.SQL("ALTER TABLE {} ATTACH PARTITION {} DEFAULT").format(n.q(n.parent), n.q(n.table))


def detach_sql(ctx: BuildContext, relation: str) -> sql.Composed:
    n = ctx.names
    return sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(n.q(n.parent), n.q(relation))


@kind("attach-old-as-default")
def attach_old_as_default(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return make_step(
        ctx,
        "attach-old-as-default",
        summary=f"ATTACH {n.table} to {n.parent} as the DEFAULT partition (no scan)",
        statements=(attach_old_sql(ctx),),
        tx=TxMode.TRANSACTION,
        # ATTACH takes only SHARE UPDATE EXCLUSIVE on the parent (writers into the
        # partitioned table go on); ACCESS EXCLUSIVE falls on the table being attached.
        locks=(
            Lock(n.parent, LockMode.SHARE_UPDATE_EXCLUSIVE),
            Lock(n.table, LockMode.ACCESS_EXCLUSIVE),
        ),
        scan="skipped: the validated CHECK implies the DEFAULT bound (statement_timeout "
        "turns an unexpected scan into a fast failure)",
        catalog_only=True,
        statement_timeout_ms=SCAN_GUARD_TIMEOUT_MS,
        preconditions=(c.relation_absent(n, n.published), *scan_guard(ctx)),
        postcondition=(c.partition_bound(n, n.table, DEFAULT_BOUND),),
        reverse=(detach_sql(ctx, n.table),),
        reverse_note=f"detach {n.table} again; if the application already publishes from "
        f"{n.parent} (V4), create a DEFAULT partition right after",
    )


@kind("swap-default")
def swap_default(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """Detach the published partition and attach the old table as DEFAULT in ONE transaction:
    between the two there must be no moment without a DEFAULT partition, or the relay's
    UPDATE … SET published_at would fail with "no partition of relation found for row"."""
    n = ctx.names
    extra: tuple[Condition, ...] = ()
    if params.get("require_copied"):
        # HOPIA: the copy trigger must have put every published row into the old table,
        # otherwise some published messages vanish from view at the swap.
        extra = (
            c.all_rows_present(
                n, n.published, n.table,
                kept_by=f"the copy trigger on {n.published} (checked under the lock) copies "
                "every row published after the scan",
            ),
            c.trigger_exists(n),
        )  # fmt: skip
    published_check = sql.Identifier(f"{n.spec.published_partition}_swap_back_check"[:63])
    reverse = (
        # Validated CHECK on the detached table (scans it, but nobody writes to it any more
        # and the parent is not locked yet) so the re-ATTACH below is catalog-only.
        sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} CHECK ({})").format(
            n.q(n.published), published_check, marker.published(n.spec)
        ),
        detach_sql(ctx, n.table),
        sql.SQL("ALTER TABLE {} ATTACH PARTITION {} DEFAULT").format(
            n.q(n.parent), n.q(n.published)
        ),
        sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(n.q(n.published), published_check),
    )
    return make_step(
        ctx,
        "swap-default",
        summary=f"In one transaction: DETACH {n.published} and ATTACH {n.table} as DEFAULT",
        statements=(detach_sql(ctx, n.published), attach_old_sql(ctx)),
        tx=TxMode.TRANSACTION,
        locks=(
            Lock(n.parent, LockMode.ACCESS_EXCLUSIVE),
            Lock(n.published, LockMode.ACCESS_EXCLUSIVE),
            Lock(n.table, LockMode.ACCESS_EXCLUSIVE),
        ),
        scan="skipped: the validated CHECK implies the DEFAULT bound; DETACH never scans",
        catalog_only=True,
        statement_timeout_ms=SCAN_GUARD_TIMEOUT_MS,
        preconditions=(
            c.partition_bound(n, n.published, DEFAULT_BOUND),
            *scan_guard(ctx),
            *extra,
        ),
        postcondition=(
            c.partition_bound(n, n.table, DEFAULT_BOUND),
            c.not_a_partition(n, n.published),
        ),
        reverse=reverse,
        reverse_note=f"re-attach {n.published} as DEFAULT and detach {n.table} (rows published "
        f"after the swap stay in {n.table})",
        reverse_preconditions=(c.relation_exists(n, n.published),),
    )
