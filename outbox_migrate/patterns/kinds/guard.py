"""The unpublished partition's guard: a DELETE that would remove an unsent message removes
nothing, unless the row is leaving through a mark or the session turned the guard off.

Why: a `ctid` names a row only within one partition. A framework's batched cleanup on the
partitioned outbox — NServiceBus's `DELETE FROM t WHERE ctid IN (SELECT ctid FROM t WHERE
"Dispatched" AND … LIMIT n)` — selects ctids of published rows and then deletes, in every
partition, the rows at those ctids: unpublished ones included. The guard is a row-level
BEFORE UPDATE OR DELETE trigger on the unpublished partition whose function returns NULL for
such a DELETE, so the statement goes on and removes the published rows it meant.

What must still pass:
* a mark — an UPDATE that moves the row to the published partition. PostgreSQL executes it
  as a DELETE from this partition (firing its row-level BEFORE DELETE triggers) and an INSERT
  into the other, right after this partition's BEFORE UPDATE triggers for the same row. The
  UPDATE branch writes the row's id into a transaction-local setting, and the DELETE branch
  lets exactly that id through. Any publisher that marks with UPDATE (a framework's own)
  keeps working, at one function call per row and branch.
* outbox-migrate's own sessions — the relay's marks and the deletes that dead-letter a row:
  `db.connect` sets `outbox_migrate.unpublished_guard = off` on every connection, and the
  trigger's WHEN clause reads it, so for them the function is never called.
* an operator who means it: `SET LOCAL outbox_migrate.unpublished_guard = off` in the
  transaction of the DELETE (docs/patterns.md).

A row that the same transaction has updated without moving it can be deleted by it: the
guard stops deletes through another row's ctid, not a transaction that names the row it has
just touched. TRUNCATE is not a row delete and is not guarded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.db import GUARD_SETTING
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind, make_step
from outbox_migrate.patterns.kinds.partitioned_table import NULL_BOUND
from outbox_migrate.patterns.model import Created, Lock, LockMode, Step, TxMode
from outbox_migrate.patterns.names import Names

MOVING_SETTING = "outbox_migrate.moving_id"
"""Transaction-local: the id of the row the last UPDATE of this partition is moving."""
COST = (
    "cost: outbox-migrate's relay never calls the trigger's function (its sessions fail the "
    "WHEN clause); a publisher of the application's own that marks with UPDATE calls it "
    "twice per marked row"
)
"""What `plan` says the guard costs (bench/guard.py measures the relay's side)."""


def create_sql(n: Names) -> tuple[sql.Composed, ...]:
    function = sql.Identifier(n.spec.schema, n.spec.guard_function)
    body = sql.SQL(
        "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $om$\n"
        "BEGIN\n"
        "    IF TG_OP = 'UPDATE' THEN\n"
        "        -- a mark that moves the row deletes it from here next: let that one through\n"
        "        PERFORM set_config({moving}, OLD.{id}::text, true);\n"
        "        RETURN NEW;\n"
        "    END IF;\n"
        "    IF current_setting({moving}, true) = OLD.{id}::text THEN\n"
        "        RETURN OLD;\n"
        "    END IF;\n"
        "    -- an unpublished row: skipped (SET LOCAL {setting} = off to delete it)\n"
        "    RETURN NULL;\n"
        "END\n"
        "$om$"
    ).format(
        function=function,
        moving=sql.Literal(MOVING_SETTING),
        id=n.id_q,
        setting=sql.SQL(GUARD_SETTING),
    )
    trigger = sql.SQL(
        "CREATE TRIGGER {trigger} BEFORE UPDATE OR DELETE ON {unpublished} FOR EACH ROW "
        "WHEN (current_setting({setting}, true) IS DISTINCT FROM 'off') "
        "EXECUTE FUNCTION {function}()"
    ).format(
        trigger=sql.Identifier(n.spec.guard_function),
        unpublished=n.q(n.unpublished),
        setting=sql.Literal(GUARD_SETTING),
        function=function,
    )
    return (body, trigger)


def drop_sql(n: Names) -> tuple[sql.Composed, ...]:
    return (
        sql.SQL("DROP TRIGGER {} ON {}").format(
            sql.Identifier(n.spec.guard_function), n.q(n.unpublished)
        ),
        sql.SQL("DROP FUNCTION {}()").format(sql.Identifier(n.spec.schema, n.spec.guard_function)),
    )


def _parts(n: Names) -> dict[str, sql.Composable]:
    return {"rel_reg": n.reg(n.unpublished), "trigger_name": sql.Literal(n.spec.guard_function)}


@kind("guard-unpublished")
def guard_unpublished(ctx: BuildContext, params: Mapping[str, Any]) -> Step | None:
    n = ctx.names
    if not n.spec.unpublished_guard:
        return None
    return make_step(
        ctx,
        "guard-unpublished",
        summary=f"Guard {n.unpublished}: other sessions' DELETEs of unpublished rows are skipped",
        statements=create_sql(n),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.unpublished, LockMode.SHARE_ROW_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(
            c.partition_bound(n, n.unpublished, NULL_BOUND),
            c.condition("trigger-absent", "guard", **_parts(n)),
            c.condition("function-absent", "guard", function_reg=n.reg(n.spec.guard_function)),
        ),
        postcondition=(c.condition("trigger-exists", "guard", **_parts(n)),),
        reverse=drop_sql(n),
        reverse_note="drop the guard's trigger and function (ctid cleanups can then delete "
        "unpublished rows again)",
        notes=(
            "A DELETE by ctid on the partitioned table (a framework's batched cleanup) skips "
            "the unpublished rows that share a ctid with the published ones it selected; "
            f"{COST}. To delete an unpublished row on purpose: SET LOCAL {GUARD_SETTING} = "
            "off in that transaction. unpublished_guard = false builds no guard.",
        ),
        creates=(
            Created("function", n.spec.guard_function),
            Created("trigger", n.spec.guard_function, on=n.unpublished),
        ),
    )
