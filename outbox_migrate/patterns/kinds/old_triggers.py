"""The old table's own triggers at the swap: offered, not imposed.

Once the old table is the DEFAULT partition, every publish moves a row into it (DELETE from
the unpublished partition + INSERT into the old table), so a row-level INSERT trigger there
fires on every publish, and HOPIA's copy trigger / HOPER's copy-back fire it for every copied
row. `plan` says which triggers exist and when they fire; this optional step disables them
(the user ones: internal constraint triggers stay), for an operator who re-created on the
partitioned parent what the application relies on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind, make_step
from outbox_migrate.patterns.model import Lock, Step, TxMode


@kind("disable-old-triggers")
def disable_old_triggers(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    return make_step(
        ctx,
        "disable-old-triggers",
        summary=f"Optional: disable the user triggers of {n.table} before it becomes a "
        "partition (they would fire on every publish)",
        statements=(sql.SQL("ALTER TABLE {} DISABLE TRIGGER USER").format(n.q(n.table)),),
        tx=TxMode.TRANSACTION,
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
