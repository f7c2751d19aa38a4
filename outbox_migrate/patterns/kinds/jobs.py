"""Job steps: work the tool does itself after the last deploy (HOPER's copy-back).

The step only describes the job and its proof; the runner hands `job` steps to
`outbox_migrate.jobs` (keyset batches, throttling, resumable high-water mark, verification).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind, make_step
from outbox_migrate.patterns.kinds.partitioned_table import DEFAULT_BOUND
from outbox_migrate.patterns.model import Lock, Step, TxMode

COPY_BATCH_ROWS = 10_000


def copy_back_loop(ctx: BuildContext) -> sql.Composed:
    """SQL-only copy-back (offline SQL, psql): keyset batches with a commit per batch.

    The library job adds throttling, a persisted high-water mark and range checksums; this
    loop is the plain equivalent a DBA can run by hand. It needs autocommit (COMMIT in DO).
    """
    n = ctx.names
    if n.spec.id_kind == "application":
        return _copy_back_loop_by_order(ctx)
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


def _copy_back_loop_by_order(ctx: BuildContext) -> sql.Composed:
    """The plain loop for application ids: the mark has the id's own type (`%TYPE`), the
    first batch has no lower bound (no uuid is below every other), and the batch's last id
    comes from ORDER BY … DESC (uuid has no max())."""
    n = ctx.names
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
    return make_step(
        ctx,
        "copy-back",
        summary=f"Copy every row of the detached {n.published} into {n.table} in keyset "
        "batches (resumable, throttled, verified)",
        statements=(copy_back_loop(ctx),),
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


@kind("drop-published")
def drop_published(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return make_step(
        ctx,
        "drop-published",
        summary=f"Drop the detached {n.published} once every row is verified in {n.table}",
        statements=(sql.SQL("DROP TABLE {}").format(n.q(n.published)),),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.published, LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(
            c.not_a_partition(n, n.published),
            c.all_rows_present(n, n.published, n.table),
        ),
        postcondition=(c.relation_absent(n, n.published),),
        reverse=None,
        reverse_note="irreversible: the point of no return of HOPER",
    )
