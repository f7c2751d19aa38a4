"""Published rows into the old table: HOPIA's copy trigger, HOPER's copy-back (described here,
carried out by `outbox_migrate.jobs`) and the drop of the detached published partition once
every row of it is there (docs/patterns.md, "HOPIA's trigger and `OVERRIDING SYSTEM VALUE`").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind
from outbox_migrate.patterns.kinds.gate_sequence import COPYING_FLAG
from outbox_migrate.patterns.kinds.partitioned_table import DEFAULT_BOUND
from outbox_migrate.patterns.model import Created, Lock, Step, TxMode
from outbox_migrate.patterns.names import Names

COPY_BATCH_ROWS = 10_000


def definer_rights(n: Names) -> sql.Composed:
    """Copy with the installer's rights: the trigger fires in the relay's session, whose role
    lost INSERT on the old table for the switch gate. The search_path is pinned (pg_catalog
    first, so a caller cannot shadow a built-in) and ends with the outbox's schema, where the
    old table's own triggers, which fire inside the copy, found their unqualified names before."""
    return sql.SQL("SECURITY DEFINER SET search_path = pg_catalog, {} ").format(
        sql.Identifier(n.spec.schema)
    )


def create_trigger_sql(
    n: Names, security: sql.Composable | None = None, *, flagged: bool = True
) -> tuple[sql.Composed, ...]:
    """`security` (empty: the invoker's rights) and `flagged=False` (database ids: their gates
    did not read the gate sequence) only rebuild what earlier releases installed, to adopt it."""
    body = "    INSERT INTO {old} OVERRIDING SYSTEM VALUE VALUES (NEW.*) ON CONFLICT DO NOTHING;\n"
    if flagged:
        # The gate sequence's trigger on the old table must not count this copy as a writer
        # (kinds/gate_sequence.py): the flag is raised around the INSERT only.
        body = (
            "    PERFORM set_config({flag}, 'on', true);\n"
            + body
            + "    PERFORM set_config({flag}, 'off', true);\n"
        )
    function = sql.SQL(
        "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql "
        "{security}AS $om$\nBEGIN\n" + body + "    RETURN NULL;\nEND\n$om$"
    ).format(
        function=n.q(n.spec.copy_function),
        old=n.q(n.table),
        flag=sql.Literal(COPYING_FLAG),
        security=definer_rights(n) if security is None else security,
    )
    trigger = sql.SQL(
        "CREATE TRIGGER {trigger} AFTER INSERT ON {published} "
        "FOR EACH ROW EXECUTE FUNCTION {function}()"
    ).format(
        trigger=sql.Identifier(n.spec.copy_trigger),
        published=n.q(n.published),
        function=n.q(n.spec.copy_function),
    )
    return (function, trigger)


def drop_trigger_sql(n: Names) -> tuple[sql.Composed, ...]:
    return (
        sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(
            sql.Identifier(n.spec.copy_trigger), n.q(n.published)
        ),
        sql.SQL("DROP FUNCTION IF EXISTS {}()").format(n.q(n.spec.copy_function)),
    )


def _created(n: Names) -> tuple[Created, ...]:
    return (
        Created("function", n.spec.copy_function),
        Created("trigger", n.spec.copy_trigger, on=n.published),
    )


@kind("install-copy-trigger")
def install_copy_trigger(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    # Earlier releases installed the function with the invoker's rights, and for database
    # ids without the copying flag: adopted as done.
    formerly = [create_trigger_sql(n, security=sql.SQL(""))]
    if n.spec.id_kind != "application":
        formerly += [
            create_trigger_sql(n, flagged=False),
            create_trigger_sql(n, security=sql.SQL(""), flagged=False),
        ]
    return Step(
        **ctx.place("install-copy-trigger"),
        summary=f"AFTER INSERT trigger on {n.published} copying each published row to {n.table}",
        statements=create_trigger_sql(n),
        locks=(Lock(n.published, LockMode.SHARE_ROW_EXCLUSIVE),),
        preconditions=(
            c.partition_bound(n, n.published, DEFAULT_BOUND),
            c.relation_exists(n, n.table),
            c.relation_empty(n, n.published),
        ),
        postcondition=(c.trigger_exists(n),),
        reverse=drop_trigger_sql(n),
        reverse_note="drop the trigger and its function",
        undone_by=("remove-copy-trigger",),
        creates=_created(n),
        formerly=tuple(formerly),
    )


@kind("remove-copy-trigger")
def remove_copy_trigger(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return Step(
        **ctx.place("remove-copy-trigger"),
        summary=f"Drop the copy trigger and its function ({n.published} is detached now)",
        statements=drop_trigger_sql(n),
        locks=(Lock(n.published, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(c.not_a_partition(n, n.published),),
        postcondition=(c.trigger_absent(n), c.function_absent(n)),
        reverse=create_trigger_sql(n),
        reverse_note="re-create the trigger and function",
        reverse_creates=_created(n),
        reverse_preconditions=(c.relation_exists(n, n.published),),
    )


def copy_back_loop(n: Names) -> sql.Composed:
    """The copy-back job's plain equivalent for offline SQL: keyset batches with a commit per
    batch (COMMIT in DO needs autocommit), without its throttling, resume and verification."""
    if n.spec.id_kind == "application":
        return _copy_back_loop_by_order(n)
    return sql.SQL(
        "DO $om_copy$\n"
        "DECLARE last_id bigint := -9223372036854775808; batch_max bigint;\n"
        "BEGIN\n"
        "    LOOP\n"
        "        WITH batch AS (SELECT * FROM {source} WHERE {id} > last_id "
        "ORDER BY {id} LIMIT {limit}),\n"
        "             copied AS (INSERT INTO {target} OVERRIDING SYSTEM VALUE "
        "SELECT * FROM batch ON CONFLICT DO NOTHING)\n"
        "        SELECT max({id}) INTO batch_max FROM batch;\n"
        "        EXIT WHEN batch_max IS NULL;\n"
        "        last_id := batch_max;\n"
        "        COMMIT;\n"
        "    END LOOP;\n"
        "END\n"
        "$om_copy$"
    ).format(
        source=n.q(n.published),
        target=n.q(n.table),
        id=n.id_q,
        limit=sql.Literal(COPY_BATCH_ROWS),
    )


def _copy_back_loop_by_order(n: Names) -> sql.Composed:
    """The plain loop for application ids: the mark has the id's own type (`%TYPE`), the
    first batch has no lower bound (no uuid is below every other), and the batch's last id
    comes from ORDER BY … DESC (uuid has no max())."""
    batch = (
        "SELECT * FROM {source}{where} ORDER BY {id} LIMIT {limit}), copied AS (INSERT INTO "
        "{target} OVERRIDING SYSTEM VALUE SELECT * FROM batch ON CONFLICT DO NOTHING) "
        "SELECT {id} INTO batch_max FROM batch ORDER BY {id} DESC LIMIT 1;\n"
    )
    parts = {
        "source": n.q(n.published),
        "target": n.q(n.table),
        "id": n.id_q,
        "limit": sql.Literal(COPY_BATCH_ROWS),
    }
    first = sql.SQL(batch).format(where=sql.SQL(""), **parts)
    rest = sql.SQL(batch).format(where=sql.SQL(" WHERE {} > last_id").format(n.id_q), **parts)
    return sql.SQL(
        "DO $om_copy$\n"
        "DECLARE last_id {column}%TYPE; batch_max {column}%TYPE;\n"
        "BEGIN\n"
        "    LOOP\n"
        "        IF last_id IS NULL THEN\n"
        "            WITH batch AS ({first}"
        "        ELSE\n"
        "            WITH batch AS ({rest}"
        "        END IF;\n"
        "        EXIT WHEN batch_max IS NULL;\n"
        "        last_id := batch_max;\n"
        "        batch_max := NULL;\n"
        "        COMMIT;\n"
        "    END LOOP;\n"
        "END\n"
        "$om_copy$"
    ).format(column=sql.Identifier(n.spec.schema, n.table, n.spec.id_column), first=first,
             rest=rest)  # fmt: skip


@kind("copy-back")
def copy_back(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return Step(
        **ctx.place("copy-back"),
        summary=f"Copy every row of the detached {n.published} into {n.table} in keyset "
        "batches (resumable, throttled, verified)",
        statements=(copy_back_loop(n),),
        tx=TxMode.AUTOCOMMIT,
        locks=(
            Lock(n.published, LockMode.ACCESS_SHARE),
            Lock(n.table, LockMode.ROW_EXCLUSIVE),
        ),
        scan=f"reads all of {n.published} in id order, one batch per transaction",
        statement_timeout_ms=None,
        preconditions=(
            c.not_a_partition(n, n.published),
            c.partition_bound(n, n.table, DEFAULT_BOUND),
        ),
        postcondition=(c.all_rows_present(n, n.published, n.table),),
        reverse=(),
        reverse_note="nothing to undo: the copies are ordinary published rows",
        notes=(
            "the runner hands this step to the copy-back job (`outbox-migrate copy-back`); "
            "the SQL shown is the plain equivalent for manual runs",
        ),
        undone_by=("drop-published",),
        executor="copy-back",
    )


def _drop_published(
    ctx: BuildContext, kind_name: str, summary: str, reverse_note: str, optional: bool = False
) -> Step:
    n = ctx.names
    return Step(
        **ctx.place(kind_name),
        summary=summary,
        statements=(sql.SQL("DROP TABLE {}").format(n.q(n.published)),),
        locks=(Lock(n.published, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(
            c.not_a_partition(n, n.published),
            c.all_rows_present(n, n.published, n.table),
        ),
        postcondition=(c.relation_absent(n, n.published),),
        reverse=None,
        reverse_note=reverse_note,
        optional=optional,
    )


@kind("drop-published")
def drop_published(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return _drop_published(
        ctx,
        "drop-published",
        f"Drop the detached {n.published} once every row is verified in {n.table}",
        "irreversible: the point of no return of HOPER",
    )


@kind("drop-detached-published")
def drop_detached_published(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return _drop_published(
        ctx,
        "drop-detached-published",
        f"Drop the detached {n.published}: every row of it is in {n.table}",
        "irreversible: the table is gone (its rows live on in the old table)",
        optional=bool(params.get("optional", False)),
    )
