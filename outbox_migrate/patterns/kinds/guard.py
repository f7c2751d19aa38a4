"""The unpublished rows' guard: a DELETE that would remove an unsent message removes nothing,
unless the session turned the guard off (docs/patterns.md, "The unpublished-row guard").

Statement-level DELETE triggers, not row-level ones or row-level security: a mark (an UPDATE
moving its row out of the partition) must fire nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.db import GUARD_SETTING
from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind
from outbox_migrate.patterns.kinds.copy_rows import definer_rights
from outbox_migrate.patterns.kinds.partitioned_table import NULL_BOUND
from outbox_migrate.patterns.model import Created, Lock, Step
from outbox_migrate.patterns.names import Names

COST = (
    "cost: none on a mark (an UPDATE, also the one that moves a row out of the unpublished "
    "partition); a DELETE on the partitioned table or the unpublished partition keeps a copy of "
    "the rows it deletes until the statement ends, and unpublished rows it hit come back with "
    "a new ctid (its row count and RETURNING still list them)"
)
"""What `plan` says the guard costs (bench/guard.py measures the relay's side)."""
TRANSITION = "om_deleted"


def triggers(n: Names) -> list[tuple[str, str]]:
    """(label, relation) of the guard's two triggers, both named like the function: the short
    label names their conditions in `plan`'s SQL. A DELETE names the partitioned table (or a
    view of it) or the partition itself, so both are guarded."""
    return [("guard", n.unpublished), ("guard-parent", n.parent)]


def create_sql(n: Names) -> tuple[sql.Composed, ...]:
    function = n.q(n.spec.guard_function)
    body = sql.SQL(
        "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql {definer}AS $om$\n"
        "DECLARE\n"
        "    stored text;\n"
        "BEGIN\n"
        "    -- the unpublished rows this DELETE removed go back (SET LOCAL {setting} = off\n"
        "    -- to delete them); every stored column, by name, so a column added later is kept\n"
        "    SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) INTO stored\n"
        "    FROM pg_attribute\n"
        "    WHERE attrelid = TG_RELID AND attnum > 0 AND NOT attisdropped AND attgenerated = '';\n"
        "    EXECUTE format('INSERT INTO %I.%I (%s) OVERRIDING SYSTEM VALUE '\n"
        "                   'SELECT %s FROM {gone} WHERE %I IS NULL',\n"
        "                   TG_TABLE_SCHEMA, TG_TABLE_NAME, stored, stored, {marker});\n"
        "    RETURN NULL;\n"
        "END\n"
        "$om$"
    ).format(
        function=function,
        definer=definer_rights(n),
        setting=sql.SQL(GUARD_SETTING),
        gone=sql.SQL(TRANSITION),
        marker=sql.Literal(n.spec.published_column),
    )
    trigger = sql.SQL(
        "CREATE TRIGGER {trigger} AFTER DELETE ON {relation} REFERENCING OLD TABLE AS {gone} "
        "FOR EACH STATEMENT WHEN (current_setting({setting}, true) IS DISTINCT FROM 'off') "
        "EXECUTE FUNCTION {function}()"
    )
    return (
        body,
        *(
            trigger.format(
                trigger=sql.Identifier(n.spec.guard_function),
                relation=n.q(relation),
                gone=sql.SQL(TRANSITION),
                setting=sql.Literal(GUARD_SETTING),
                function=function,
            )
            for _, relation in triggers(n)
        ),
    )


def drop_sql(n: Names) -> tuple[sql.Composed, ...]:
    name = sql.Identifier(n.spec.guard_function)
    return (
        *(sql.SQL("DROP TRIGGER {} ON {}").format(name, n.q(r)) for _, r in triggers(n)),
        sql.SQL("DROP FUNCTION {}()").format(n.q(n.spec.guard_function)),
    )


@kind("guard-unpublished")
def guard_unpublished(ctx: BuildContext, params: Mapping[str, Any]) -> Step | None:
    n = ctx.names
    if not n.spec.unpublished_guard:
        return None
    name = n.spec.guard_function
    return Step(
        **ctx.place("guard-unpublished"),
        summary=f"Guard {n.unpublished}: unpublished rows other sessions DELETE are written back",
        statements=create_sql(n),
        locks=(
            Lock(n.unpublished, LockMode.SHARE_ROW_EXCLUSIVE),
            Lock(n.parent, LockMode.SHARE_ROW_EXCLUSIVE),
        ),
        catalog_only=True,
        preconditions=(
            c.partition_bound(n, n.unpublished, NULL_BOUND),
            *(c.on_trigger("trigger-absent", n, r, name, label) for label, r in triggers(n)),
            c.condition("function-absent", "guard", function_reg=n.reg(n.spec.guard_function)),
        ),
        postcondition=tuple(
            c.on_trigger("trigger-exists", n, r, name, label) for label, r in triggers(n)
        ),
        reverse=drop_sql(n),
        reverse_note="drop the guard's triggers and function (ctid cleanups can then delete "
        "unpublished rows again)",
        notes=(
            "A DELETE by ctid on the partitioned table (a framework's batched cleanup) writes "
            "back the unpublished rows that share a ctid with the published ones it selected; "
            f"{COST}. To delete an unpublished row on purpose: SET LOCAL {GUARD_SETTING} = "
            "off in that transaction. unpublished_guard = false builds no guard.",
        ),
        creates=(
            Created("function", n.spec.guard_function),
            *(Created("trigger", name, on=r) for _, r in triggers(n)),
        ),
    )
