"""The spec's column roles checked against the live table before any worker starts: a wrong
name or type is one line and exit 2, never a worker failure. Reads the catalog, writes nothing.
"""

from __future__ import annotations

from typing import Any

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import RelayError
from outbox_migrate.relay import queries
from outbox_migrate.relay.options import Ordering

PAYLOAD_TYPES = ("jsonb", "json", "text", "bytea")


def resolve(
    conn: Any,
    source: queries.Source,
    spec: OutboxSpec,
    key_column: str | None,
    event_type_column: str | None,
    ordering: Ordering,
) -> queries.Columns:
    """A default column role is used when the table has it; one configured must exist."""
    rows = conn.execute(
        queries.named("table-columns"), {"schema": source.schema, "table": source.mark_table}
    ).fetchall()
    types = {str(r[0]): str(r[1]) for r in rows}
    if not types:
        raise RelayError(f"table {source.label} does not exist")
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
