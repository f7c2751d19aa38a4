"""Job steps: work the tool does itself after the last deploy (HOPER's copy-back).

The step only describes the job and its proof; the runner hands `job` steps to
`outbox_migrate.jobs` (keyset batches, throttling, resumable high-water mark, verification).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds import BuildContext, kind, make_step
from outbox_migrate.patterns.kinds.partitioned_table import DEFAULT_BOUND
from outbox_migrate.patterns.model import Lock, LockMode, Step, TxMode


@kind("copy-back")
def copy_back(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return make_step(
        ctx,
        "copy-back",
        summary=f"Copy every row of the detached {n.published} into {n.table} in keyset "
        "batches (resumable, throttled, verified)",
        statements=(),
        tx=TxMode.NONE,
        locks=(
            Lock(n.display(n.published), LockMode.ACCESS_SHARE),
            Lock(n.display(n.table), LockMode.ROW_EXCLUSIVE),
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
        notes=("run by `outbox-migrate copy-back`, or by the runner as this step",),
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
        locks=(Lock(n.display(n.published), LockMode.ACCESS_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(
            c.not_a_partition(n, n.published),
            c.all_rows_present(n, n.published, n.table),
        ),
        postcondition=(c.relation_absent(n, n.published),),
        reverse=None,
        reverse_note="irreversible: the point of no return of HOPER",
    )
