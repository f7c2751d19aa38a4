"""Making the old table the DEFAULT partition: the CHECK that lets ATTACH skip its scan, the
old table's own triggers, COPRA's attach and HOPER/HOPIA's swap (docs/patterns.md, "PostgreSQL
facts the catalog relies on"). The scan guard proves the CHECK implies the bound; the statement
still runs under a tight statement_timeout, so a scan PostgreSQL chose anyway fails fast.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns import marker
from outbox_migrate.patterns.kinds.base import BuildContext, kind
from outbox_migrate.patterns.kinds.partitioned_table import DEFAULT_BOUND
from outbox_migrate.patterns.model import SCAN_GUARD_TIMEOUT_MS, Condition, Created, Lock, Step
from outbox_migrate.patterns.names import Names


def add_check_sql(n: Names) -> sql.Composed:
    return sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} CHECK ({}) NOT VALID").format(
        n.q(n.table), n.check_q, marker.published(n.spec)
    )


def drop_check_sql(n: Names) -> sql.Composed:
    return sql.SQL("ALTER TABLE {} DROP CONSTRAINT IF EXISTS {}").format(n.q(n.table), n.check_q)


def not_null_sql(n: Names, action: str) -> sql.Composed:
    return sql.SQL("ALTER TABLE {} ALTER COLUMN {} {} NOT NULL").format(
        n.q(n.table), n.published_at_q, sql.SQL(action)
    )


@kind("add-not-valid-check")
def add_not_valid_check(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """New rows are checked at once, so every writer of unpublished rows into the old table
    must be gone and the table drained before this runs."""
    n = ctx.names
    return Step(
        **ctx.place("add-not-valid-check"),
        summary=f"Add CHECK ({marker.describe_published(n.spec)}) NOT VALID to {n.table}",
        statements=(add_check_sql(n),),
        locks=(Lock(n.table, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(*ctx.deploy_gate(n.table), c.drained(n, n.table, ctx.phase)),
        postcondition=(c.check_exists(n),),
        reverse=(drop_check_sql(n),),
        reverse_note="drop the constraint",
        undone_by=("drop-check",),
        creates=(Created("constraint", n.spec.check_name, on=n.table),),
    )


@kind("validate-check")
def validate_check(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return Step(
        **ctx.place("validate-check"),
        summary=f"VALIDATE the CHECK on {n.table} in its own transaction",
        statements=(
            sql.SQL("ALTER TABLE {} VALIDATE CONSTRAINT {}").format(n.q(n.table), n.check_q),
        ),
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
    return Step(
        **ctx.place("set-not-null"),
        summary=f"Optional: SET NOT NULL on {n.table}.{n.spec.published_column}, proven by the "
        "validated CHECK",
        statements=(not_null_sql(n, "SET"),),
        locks=(Lock(n.table, LockMode.ACCESS_EXCLUSIVE),),
        scan="none: the validated CHECK proves it (a scan would hit the statement_timeout)",
        catalog_only=True,
        statement_timeout_ms=SCAN_GUARD_TIMEOUT_MS,
        preconditions=(c.check_exists(n), c.check_validated(n)),
        postcondition=(c.column_not_null(n),),
        reverse=(not_null_sql(n, "DROP"),),
        reverse_note="drop the NOT NULL",
        optional=True,
    )


@kind("drop-check")
def drop_check(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return Step(
        **ctx.place("drop-check"),
        summary=f"Drop the now-redundant CHECK from {n.table} (the partition bound says it)",
        statements=(drop_check_sql(n),),
        locks=(Lock(n.table, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(c.partition_bound(n, n.table, DEFAULT_BOUND),),
        postcondition=(c.check_absent(n),),
        reverse=(add_check_sql(n),),
        reverse_note="re-add the CHECK as NOT VALID (catalog-only)",
        reverse_creates=(Created("constraint", n.spec.check_name, on=n.table),),
    )


@kind("disable-old-triggers")
def disable_old_triggers(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """Offered, not imposed: as the DEFAULT partition the old table gets a row on every
    publish, so its INSERT triggers would fire for each (docs/patterns.md, "Objects on the old
    table"). Internal constraint triggers stay."""
    n = ctx.names
    return Step(
        **ctx.place("disable-old-triggers"),
        summary=f"Optional: disable the user triggers of {n.table} before it becomes a "
        "partition (they would fire on every publish)",
        statements=(sql.SQL("ALTER TABLE {} DISABLE TRIGGER USER").format(n.q(n.table)),),
        # ALTER TABLE … DISABLE TRIGGER takes SHARE ROW EXCLUSIVE: writers wait for the
        # catalog change only.
        locks=(Lock(n.table, LockMode.SHARE_ROW_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(c.relation_exists(n, n.table),),
        postcondition=(c.no_enabled_user_triggers(n, n.table),),
        reverse=(sql.SQL("ALTER TABLE {} ENABLE TRIGGER USER").format(n.q(n.table)),),
        reverse_note="enable the user triggers again (also any that were disabled before "
        "the migration)",
        optional=True,
        notes=(
            "Re-create on the partitioned table first whatever the application relies on; "
            "`plan --dsn` lists the triggers and when each fires.",
        ),
    )


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


def attach_sql(n: Names, relation: str) -> sql.Composed:
    return sql.SQL("ALTER TABLE {} ATTACH PARTITION {} DEFAULT").format(
        n.q(n.parent), n.q(relation)
    )


def detach_sql(n: Names, relation: str) -> sql.Composed:
    return sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(n.q(n.parent), n.q(relation))


@kind("attach-old-as-default")
def attach_old_as_default(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return Step(
        **ctx.place("attach-old-as-default"),
        summary=f"ATTACH {n.table} to {n.parent} as the DEFAULT partition (no scan)",
        statements=(attach_sql(n, n.table),),
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
        reverse=(detach_sql(n, n.table),),
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
        detach_sql(n, n.table),
        attach_sql(n, n.published),
        sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(n.q(n.published), published_check),
    )
    return Step(
        **ctx.place("swap-default"),
        summary=f"In one transaction: DETACH {n.published} and ATTACH {n.table} as DEFAULT",
        statements=(detach_sql(n, n.published), attach_sql(n, n.table)),
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
