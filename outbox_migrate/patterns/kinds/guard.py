"""The unpublished partition's guard: a DELETE that would remove an unsent message removes
nothing, unless the row is leaving through a mark or the session turned the guard off.

Why: a `ctid` names a row only within one partition. A framework's batched cleanup on the
partitioned outbox — NServiceBus's `DELETE FROM t WHERE ctid IN (SELECT ctid FROM t WHERE
"Dispatched" AND … LIMIT n)` — selects ctids of published rows and then deletes, in every
partition, the rows at those ctids: unpublished ones included. The guard is a row-level
BEFORE DELETE trigger on the unpublished partition whose function returns NULL for such a
DELETE, so the statement goes on and removes the published rows it meant.

What must still pass:
* a mark — an UPDATE on the partitioned table that moves the row to the published partition.
  PostgreSQL executes the move as a DELETE from this partition, firing its row-level BEFORE
  DELETE triggers. Two statement-level triggers on the partitioned table raise a
  transaction-local flag before each UPDATE statement and lower it after, and the DELETE
  branch lets rows through while it is up. Any publisher that marks with UPDATE (a
  framework's own, through the table, a view of it or a MERGE) keeps working, at one function
  call per marked row and two per statement. Statement-level rather than a row-level BEFORE
  UPDATE that names the moving row: every row trigger makes the executor fetch and lock the
  row again, which the relay's drain pays per row even when the trigger's WHEN clause is
  false (bench/README.md).
* outbox-migrate's own sessions — the relay's marks and the deletes that dead-letter a row:
  `db.connect` sets `outbox_migrate.unpublished_guard = off` on every connection, and the
  triggers' WHEN clause reads it, so for them the function is never called.
* an operator who means it: `SET LOCAL outbox_migrate.unpublished_guard = off` in the
  transaction of the DELETE (docs/patterns.md).

A DELETE inside an UPDATE statement on the partitioned table (a MERGE's DELETE action, a
writable CTE beside an UPDATE) passes too. TRUNCATE is not a row delete and is not guarded.
The flag goes down with a failed statement's (sub)transaction, as every local setting does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.db import GUARD_SETTING
from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind, make_step
from outbox_migrate.patterns.kinds.partitioned_table import NULL_BOUND
from outbox_migrate.patterns.model import Created, Lock, Step, TxMode
from outbox_migrate.patterns.names import Names

MARKING_SETTING = "outbox_migrate.marking"
"""Transaction-local: `on` while an UPDATE statement on the partitioned table runs."""
COST = (
    "cost: outbox-migrate's relay never calls the trigger function (its sessions fail the "
    "triggers' WHEN clause); a publisher of the application's own that marks with UPDATE "
    "calls it once per marked row and twice per statement"
)
"""What `plan` says the guard costs (bench/guard.py measures the relay's side)."""
MAX_IDENTIFIER_BYTES = 63


def trigger_names(n: Names) -> tuple[str, str, str]:
    """The row trigger on the unpublished partition (the function's name), then the two
    statement triggers on the partitioned table, before and after an UPDATE."""
    name = n.spec.guard_function
    cut = name.encode()[: MAX_IDENTIFIER_BYTES - len("_before")].decode(errors="ignore")
    return name, f"{cut}_before", f"{cut}_after"


def create_sql(n: Names) -> tuple[sql.Composed, ...]:
    function = sql.Identifier(n.spec.schema, n.spec.guard_function)
    body = sql.SQL(
        "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $om$\n"
        "BEGIN\n"
        "    IF TG_LEVEL = 'STATEMENT' THEN\n"
        "        -- an UPDATE of the partitioned table: the rows it moves out are deleted here\n"
        "        PERFORM set_config({marking}, CASE TG_WHEN WHEN 'BEFORE' THEN 'on' ELSE '' END,"
        " true);\n"
        "        RETURN NULL;\n"
        "    END IF;\n"
        "    IF current_setting({marking}, true) = 'on' THEN\n"
        "        RETURN OLD;\n"
        "    END IF;\n"
        "    -- an unpublished row: skipped (SET LOCAL {setting} = off to delete it)\n"
        "    RETURN NULL;\n"
        "END\n"
        "$om$"
    ).format(
        function=function,
        marking=sql.Literal(MARKING_SETTING),
        setting=sql.SQL(GUARD_SETTING),
    )
    row, before, after = trigger_names(n)
    when = sql.SQL("WHEN (current_setting({}, true) IS DISTINCT FROM 'off')").format(
        sql.Literal(GUARD_SETTING)
    )
    trigger = sql.SQL(
        "CREATE TRIGGER {trigger} {timing} ON {relation} FOR EACH {level} {when} "
        "EXECUTE FUNCTION {function}()"
    )
    return (
        body,
        trigger.format(trigger=sql.Identifier(row), timing=sql.SQL("BEFORE DELETE"),
                       relation=n.q(n.unpublished), level=sql.SQL("ROW"), when=when,
                       function=function),
        trigger.format(trigger=sql.Identifier(before), timing=sql.SQL("BEFORE UPDATE"),
                       relation=n.q(n.parent), level=sql.SQL("STATEMENT"), when=when,
                       function=function),
        trigger.format(trigger=sql.Identifier(after), timing=sql.SQL("AFTER UPDATE"),
                       relation=n.q(n.parent), level=sql.SQL("STATEMENT"), when=when,
                       function=function),
    )  # fmt: skip


def drop_sql(n: Names) -> tuple[sql.Composed, ...]:
    row, before, after = trigger_names(n)
    return (
        sql.SQL("DROP TRIGGER {} ON {}").format(sql.Identifier(row), n.q(n.unpublished)),
        sql.SQL("DROP TRIGGER {} ON {}").format(sql.Identifier(before), n.q(n.parent)),
        sql.SQL("DROP TRIGGER {} ON {}").format(sql.Identifier(after), n.q(n.parent)),
        sql.SQL("DROP FUNCTION {}()").format(sql.Identifier(n.spec.schema, n.spec.guard_function)),
    )


def _triggers(n: Names) -> list[tuple[str, str, str]]:
    """(label, trigger, relation) of each of the guard's triggers; the short label names its
    conditions (the trigger's own name would not fit `plan`'s SQL in 80 columns)."""
    row, before, after = trigger_names(n)
    return [("guard", row, n.unpublished), ("guard-before", before, n.parent),
            ("guard-after", after, n.parent)]  # fmt: skip


def _on(n: Names, trigger: str, relation: str) -> dict[str, sql.Composable]:
    return {"rel_reg": n.reg(relation), "trigger_name": sql.Literal(trigger)}


@kind("guard-unpublished")
def guard_unpublished(ctx: BuildContext, params: Mapping[str, Any]) -> Step | None:
    n = ctx.names
    if not n.spec.unpublished_guard:
        return None
    triggers = _triggers(n)
    return make_step(
        ctx,
        "guard-unpublished",
        summary=f"Guard {n.unpublished}: other sessions' DELETEs of unpublished rows are skipped",
        statements=create_sql(n),
        tx=TxMode.TRANSACTION,
        locks=(
            Lock(n.unpublished, LockMode.SHARE_ROW_EXCLUSIVE),
            Lock(n.parent, LockMode.SHARE_ROW_EXCLUSIVE),
        ),
        catalog_only=True,
        preconditions=(
            c.partition_bound(n, n.unpublished, NULL_BOUND),
            *(c.condition("trigger-absent", label, **_on(n, t, r)) for label, t, r in triggers),
            c.condition("function-absent", "guard", function_reg=n.reg(n.spec.guard_function)),
        ),
        postcondition=tuple(
            c.condition("trigger-exists", label, **_on(n, t, r)) for label, t, r in triggers
        ),
        reverse=drop_sql(n),
        reverse_note="drop the guard's triggers and function (ctid cleanups can then delete "
        "unpublished rows again)",
        notes=(
            "A DELETE by ctid on the partitioned table (a framework's batched cleanup) skips "
            "the unpublished rows that share a ctid with the published ones it selected; "
            f"{COST}. To delete an unpublished row on purpose: SET LOCAL {GUARD_SETTING} = "
            "off in that transaction. unpublished_guard = false builds no guard.",
        ),
        creates=(
            Created("function", n.spec.guard_function),
            *(Created("trigger", t, on=r) for _, t, r in triggers),
        ),
    )
