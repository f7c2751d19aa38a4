"""Deploy gates: steps with no SQL whose preconditions prove the previous deploy finished.

A gate is where the runner stops a premature `run --to V3`: the old table still taking new ids
(a V1 writer is alive), unpublished rows left in a table nobody will publish from, or sessions
of the outgoing version still connected.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind, make_step
from outbox_migrate.patterns.kinds.original_name import unseal_sql
from outbox_migrate.patterns.model import Condition, Step, TxMode


@kind("gate-old-table-retired")
def gate_old_table_retired(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    checks: list[Condition] = [c.relation_exists(n, n.table), *ctx.deploy_gate(n.table)]
    checks.append(c.drained(n, n.table, ctx.phase))
    return make_step(
        ctx,
        "gate-old-table-retired",
        summary=f"Gate: no writer inserts into {n.table} any more and it is fully published",
        statements=(),
        tx=TxMode.NONE,
        locks=(),
        preconditions=tuple(checks),
        postcondition=(),
        # `unseal` (COP, HOP): going back before V3 the old version may insert into the flat
        # table again, so the seal the rename to the original name left on it goes.
        reverse=(unseal_sql(n),) if params.get("unseal", False) else (),
        reverse_note="nothing to undo (but the original-name phase's seal, if any)"
        if params.get("unseal", False)
        else "nothing to undo",
        statement_timeout_ms=None,
    )
