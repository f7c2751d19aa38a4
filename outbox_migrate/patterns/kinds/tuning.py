"""Autovacuum settings for the insert-only published partition (and the old table once it
takes that role): vacuum and analyze every 100 k inserted rows regardless of table size,
where PostgreSQL's size-scaled defaults would wait ever longer as the partition grows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind, make_step
from outbox_migrate.patterns.model import Lock, Step, TxMode

_TARGETS = {"published", "old"}


@kind("tune-autovacuum")
def tune_autovacuum(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    target = str(params.get("target", "published"))
    if target not in _TARGETS:
        raise ValueError(f"tune-autovacuum target must be one of {sorted(_TARGETS)}")
    relation = n.published if target == "published" else n.table
    settings = sql.SQL(", ").join(
        sql.SQL("{} = {}").format(sql.SQL(key), sql.Literal(int(value)))
        for key, value in c.AUTOVACUUM_INSERT_ONLY
    )
    keys = sql.SQL(", ").join(sql.SQL(key) for key, _ in c.AUTOVACUUM_INSERT_ONLY)
    suffix = "" if target == "published" else "-old"
    return make_step(
        ctx,
        f"tune-autovacuum{suffix}",
        summary=f"Insert-only autovacuum settings on {relation} (every 100 k inserts)",
        statements=(sql.SQL("ALTER TABLE {} SET ({})").format(n.q(relation), settings),),
        tx=TxMode.TRANSACTION,
        locks=(Lock(relation, LockMode.SHARE_UPDATE_EXCLUSIVE),),
        preconditions=(c.relation_exists(n, relation),),
        postcondition=(c.autovacuum_tuned(n, relation),),
        reverse=(sql.SQL("ALTER TABLE {} RESET ({})").format(n.q(relation), keys),),
        reverse_note="reset the four settings to the server defaults",
        # The published partition is detached by the swap and may be dropped afterwards.
        undone_by=("swap-default",) if target == "published" else (),
    )
