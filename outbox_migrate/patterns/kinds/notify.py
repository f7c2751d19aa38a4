"""The relay's wake-up trigger on the partitioned outbox (its DDL and key: patterns/notify.py).

Installed where the partitioned table is created, so the relay of that phase wakes on new rows
without the application calling `pg_notify`. The trigger only notifies while a relay is idle,
so the commit-time cost of NOTIFY stays off busy traffic. Statement-level triggers are not
cloned to partitions and a cross-partition UPDATE (the relay's mark) does not fire them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.config import DEFAULT_CHANNEL
from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns import notify
from outbox_migrate.patterns.kinds.base import BuildContext, kind, make_step
from outbox_migrate.patterns.model import Created, Lock, Step, TxMode


def _trigger_parts(ctx: BuildContext) -> dict[str, sql.Composable]:
    n = ctx.names
    return {"rel_reg": n.reg(n.parent), "trigger_name": sql.Literal(notify.TRIGGER_NAME)}


@kind("install-notify-trigger")
def install_notify_trigger(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    channel = str(params.get("channel", DEFAULT_CHANNEL))
    return make_step(
        ctx,
        "install-notify-trigger",
        summary=f"Statement-level AFTER INSERT trigger on {n.parent} waking an idle relay",
        statements=notify.create_sql(n.spec, channel),
        tx=TxMode.TRANSACTION,
        locks=(Lock(n.parent, LockMode.SHARE_ROW_EXCLUSIVE),),
        catalog_only=True,
        preconditions=(c.partitioned_by_list(n),),
        postcondition=(c.condition("trigger-exists", "notify", **_trigger_parts(ctx)),),
        reverse=notify.drop_sql(n.spec),
        reverse_note="drop the wake-up trigger and its function (the relay falls back to polling)",
        creates=(
            Created("function", notify.function_name(n.spec)),
            Created("trigger", notify.TRIGGER_NAME, on=n.parent),
        ),
    )
