"""The relay's sources resolved against the live database, each with its claim relation's OID
(marks by ctid are confined to it), and checked later: names can change under a running relay.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import NamesMoved, RelayError
from outbox_migrate.patterns import marker_catalog
from outbox_migrate.relay import queries
from outbox_migrate.relay.switching import SourceState

NAMES_CHECK_S = 5.0
"""How often a worker looks at its names between batches (one catalog query)."""


def resolved(conn: Any, spec: OutboxSpec, state: SourceState) -> tuple[OutboxSpec, SourceState]:
    """The spec and the sources to claim from, each with its claim relation's OID. A nullable
    flag is accepted: only partitioning needs NOT NULL."""
    found = marker_catalog.resolve(conn, spec, to_partition=False)
    if found != spec:
        state = SourceState(found, state.mode, state.gate, state.old_app)
    state.resolve(lambda source: with_oid(conn, source))
    return found, state


def with_oid(conn: Any, source: queries.Source) -> queries.Source:
    claim = queries.qualified(source.schema, source.claim_table)
    row = conn.execute("SELECT coalesce(to_regclass(%s)::oid, 0)::int8", (claim,)).fetchone()
    return replace(source, claim_oid=int(row[0]) if row else 0)


def check_markable(conn: Any, source: queries.Source) -> None:
    """Refuse (exit 2) a source whose marks could not be confined to its claim relation: a
    view under the partitioned table's former name made by an earlier release's rename has
    `ctid` but no `tableoid` column."""
    mark = queries.qualified(source.schema, source.mark_table)
    row = conn.execute(
        "SELECT c.relkind = 'v' AND NOT EXISTS (SELECT FROM pg_attribute a WHERE "
        "a.attrelid = c.oid AND a.attname = 'tableoid' AND NOT a.attisdropped) "
        "FROM pg_class c WHERE c.oid = to_regclass(%s)",
        (mark,),
    ).fetchone()
    if row and row[0]:
        raise RelayError(
            f"{source.label} is a view without a tableoid column (made by an earlier "
            "release's rename): start the relay with the original name "
            "(--partitioned-table), which the rename gave the partitioned table"
        )


def check_names(conn: Any, source: queries.Source) -> None:
    """Raise `NamesMoved` when the claim's name no longer means the relation the relay
    started with, or the mark's name no longer reaches it."""
    if not source.claim_oid:
        return
    claim = queries.qualified(source.schema, source.claim_table)
    mark = queries.qualified(source.schema, source.mark_table)
    row = conn.execute(
        queries.named("names-now"), {"claim": claim, "mark": mark, "claim_oid": source.claim_oid}
    ).fetchone()
    now, reaches = (int(row[0]), bool(row[1])) if row else (0, False)
    if now == source.claim_oid and reaches:
        return
    if now != source.claim_oid:
        what = f"{claim} no longer names the table it claimed from at start"
    else:
        what = f"{mark} no longer reaches the table {claim} the relay claims from"
    raise NamesMoved(
        f"relay stopped: {what} (renamed, or a rename rolled back, while it ran); nothing "
        "was marked in another table — start the relay with the names now in force"
    )
