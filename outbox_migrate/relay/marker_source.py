"""The relay's sources and their columns resolved against the live database before any worker
starts (a wrong name or type is one line and exit 2), each source with its claim relation's OID
(marks by ctid are confined to it); and the names checked again while the relay runs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import NamesMoved, RelayError
from outbox_migrate.patterns import marker_catalog
from outbox_migrate.relay import queries
from outbox_migrate.relay.options import Ordering
from outbox_migrate.relay.switching import SourceState

NAMES_CHECK_S = 5.0
"""How often a worker looks at its names between batches (one catalog query)."""
PAYLOAD_TYPES = ("jsonb", "json", "text", "bytea")


def resolve_columns(
    conn: Any,
    source: queries.Source,
    spec: OutboxSpec,
    key_column: str | None,
    event_type_column: str | None,
    ordering: Ordering,
) -> queries.Columns:
    """The spec's column roles checked against the live table: a default one is used when
    the table has it, one configured must exist."""
    rows = conn.execute(
        queries.named("table-columns"), {"schema": source.schema, "table": source.mark_table}
    ).fetchall()
    types = {str(r[0]): str(r[1]) for r in rows}
    if not types:
        option = "--partitioned-table" if source.partitioned else "--table"
        raise RelayError(
            f"table {source.label} does not exist; name the outbox with --schema and {option}"
        )
    defaults = OutboxSpec()
    required = [source.id_column, source.published_column, spec.payload_column]
    required += [spec.created_column] if spec.created_column else []
    required += [spec.status_column] if spec.status_column else []
    required += list(spec.metadata_columns)
    missing = [c for c in required if c not in types]
    if missing:
        raise RelayError(
            f"table {source.label} has no column(s) {', '.join(missing)}; name the "
            "outbox's columns with the column-role settings (docs/configuration.md)"
        )

    check_ids(source, types, spec.id_kind == "application", ordering)

    def optional(given: str | None, configured: str, default: str) -> str | None:
        name = given if given is not None else configured
        if not name:
            return None
        if name in types:
            return name
        if given is None and name == default:
            return None
        raise RelayError(f"table {source.label} has no column {name!r}")

    headers = optional(None, spec.headers_column, defaults.headers_column)
    payload_type = types[spec.payload_column]
    if payload_type not in PAYLOAD_TYPES:
        raise RelayError(
            f"{source.label}.{spec.payload_column} is {payload_type}; the payload must be "
            f"one of {', '.join(PAYLOAD_TYPES)}"
        )
    key = optional(key_column, spec.key_column, defaults.key_column)
    if ordering is Ordering.key and key is None:
        raise RelayError(
            f"--ordering key needs a key column; {source.label} has no message_key "
            "(name yours with --key-column)"
        )
    return queries.Columns(
        event_type=optional(event_type_column, spec.event_type_column, defaults.event_type_column),
        key=key,
        payload=spec.payload_column,
        created_at=spec.created_column or None,
        payload_type=payload_type,
        headers=headers,
        headers_type=types[headers] if headers else "jsonb",
        metadata=spec.metadata_columns,
    )


def check_ids(
    source: queries.Source, types: dict[str, str], text_ids: bool, ordering: Ordering
) -> None:
    """The id kind configured must match the table's id column (which integers are the
    application's is the migration's judgement, not the relay's)."""
    id_type = types[source.id_column]
    integer = id_type in ("bigint", "integer", "smallint")
    if not integer and not text_ids:
        raise RelayError(
            f"{source.label}.{source.id_column} is {id_type}: set id_kind = application "
            "(and order_column, unless the ids sort by time as uuidv7 and ULID do)"
        )
    if source.order_column and source.order_column not in types:
        raise RelayError(f"table {source.label} has no column {source.order_column!r}")
    if source.order_column and ordering is Ordering.key:
        raise RelayError(
            "--ordering key with application ids needs them claimed by id (order_column "
            "unset: uuidv7, ULID); a parked key compares ids"
        )


def resolved(conn: Any, spec: OutboxSpec, state: SourceState) -> tuple[OutboxSpec, SourceState]:
    """The spec and the sources to claim from, each with its claim relation's OID. A nullable
    flag is accepted: only partitioning needs NOT NULL."""
    found = marker_catalog.resolve(conn, spec, to_partition=False)
    if found != spec:
        state = SourceState(found, state.mode, state.gate, state.old_app)
    state.resolve(lambda source: with_oid(conn, source))
    return found, state


def with_oid(conn: Any, source: queries.Source) -> queries.Source:
    """`source` with the OID of its claim relation (0 when it does not exist)."""
    claim = queries.qualified(source.schema, source.claim_table)
    row = conn.execute("SELECT coalesce(to_regclass(%s)::oid, 0)::int8", (claim,)).fetchone()
    return replace(source, claim_oid=int(row[0]) if row else 0)


def check_markable(conn: Any, source: queries.Source) -> None:
    """Refuse (exit 2) a source whose marks could not be confined to its claim relation (a
    view under the partitioned table's former name made by an earlier release's rename has
    `ctid` but no `tableoid` column), or could not move a row anywhere (a partitioned table
    whose only partition is the unpublished one: COPRA before V4)."""
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
    claim = queries.qualified(source.schema, source.claim_table)
    row = conn.execute(
        "SELECT c.relkind = 'p' AND NOT EXISTS (SELECT FROM pg_inherits i WHERE i.inhparent = "
        "c.oid AND i.inhrelid <> u.oid) FROM pg_class c, pg_class u "
        "WHERE c.oid = to_regclass(%s) AND u.oid = to_regclass(%s)",
        (mark, claim),
    ).fetchone()
    if row and row[0]:
        # COPRA's V2 layout: the old table becomes the DEFAULT partition only before V4.
        raise RelayError(
            f"{mark} has no partition for published rows besides {claim}: a mark would have "
            "nowhere to move them; COPRA publishes from the partitioned table from V4 on, "
            "run the relay with --mode flat until then"
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
