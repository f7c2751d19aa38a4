"""The `dead-letters` command's work: list, show, requeue and purge (docs/relay.md, "Dead
letters and attempts"). One call, one transaction, never waiting long on a lock; the SQL is
composed here because its parts depend on the selection and the target table.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import UsageError
from outbox_migrate.sql import query

COPY_SUFFIX = " copy "  # relay/bad_rows.py COPY_LABEL
COLUMNS = (
    "source_table", "id", "event_type", "message_key", "payload", "payload_bytes", "created_at",
    "attempts", "last_error", "reasons", "delivered", "headers", "dead_at",
)  # fmt: skip
LOCK_TIMEOUT = "2s"


@dataclass(frozen=True)
class Selection:
    """Which dead letters: every given criterion must hold (`reason`: a substring of any)."""

    ids: tuple[str, ...] = ()
    reason: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    source: str | None = None

    @property
    def empty(self) -> bool:
        return not (self.ids or self.reason or self.since or self.until or self.source)

    def where(self) -> tuple[sql.Composable, dict[str, Any]]:
        parts: list[sql.Composable] = [sql.SQL("true")]
        params: dict[str, Any] = {}
        if self.ids:
            parts.append(sql.SQL("d.id::text = ANY(%(ids)s::text[])"))
            params["ids"] = list(self.ids)
        if self.reason:
            parts.append(sql.SQL(
                "(strpos(d.last_error, %(reason)s) > 0 OR EXISTS (SELECT FROM "
                "unnest(d.reasons) r WHERE strpos(r, %(reason)s) > 0))"
            ))  # fmt: skip
            params["reason"] = self.reason
        if self.since:
            parts.append(sql.SQL("d.dead_at >= %(since)s"))
            params["since"] = self.since
        if self.until:
            parts.append(sql.SQL("d.dead_at < %(until)s"))
            params["until"] = self.until
        if self.source:
            parts.append(sql.SQL("(d.source_table = %(source)s OR starts_with(d.source_table, "
                                 "%(source)s || ' copy '))"))  # fmt: skip
            params["source"] = self.source
        return sql.SQL(" AND ").join(parts), params


def listed(
    conn: Any, schema: str, table: str, selection: Selection, limit: int
) -> list[dict[str, Any]]:
    """The selected dead letters, oldest first, as JSON-ready dicts (raw payloads as hex)."""
    where, params = selection.where()
    rows = conn.execute(
        query("relay", "list-dead-letters").compose(
            columns=sql.SQL(", ").join(sql.SQL("d.{}").format(sql.Identifier(c)) for c in COLUMNS),
            table=sql.Identifier(schema, table), where=where, limit=sql.Literal(limit),
        ),
        params,
    ).fetchall()  # fmt: skip
    out = []
    for row in rows:
        item = dict(zip(COLUMNS, row, strict=True))
        item["id"] = str(item["id"])
        raw = item.pop("payload_bytes")
        if raw is not None:
            item["payload_hex"] = bytes(raw).hex()
        item["headers"] = [list(p) for p in item["headers"] or []]
        out.append(item)
    return out


def purge(conn: Any, schema: str, table: str, selection: Selection) -> list[str]:
    """Delete the selected dead letters for good; returns their ids. Refuses an empty
    selection: deleting every dead letter takes saying which."""
    where, params = _where("purge", selection)
    with conn.transaction():
        _lock_timeout(conn)
        rows = conn.execute(
            query("relay", "purge-dead-letters").compose(
                table=sql.Identifier(schema, table), where=where
            ),
            params,
        ).fetchall()
    return [str(r[0]) for r in rows]


@dataclass(frozen=True)
class Requeued:
    source_table: str
    old_id: str
    new_id: str


def requeue(
    conn: Any,
    spec: OutboxSpec,
    table: str,
    attempts_table: str,
    selection: Selection,
    *,
    new_id: bool,
    channel: str,
) -> list[Requeued]:
    """Write the selected dead letters back as unpublished rows, oldest first, and drop them
    and their counters in the same transaction: a message is waiting or dead-lettered, never
    both, never neither. Refuses an empty selection, a source table that is gone, and
    `new_id` without an id default (`UsageError`)."""
    schema = spec.schema
    where, params = _where("requeue", selection)
    done: list[Requeued] = []
    with conn.transaction():
        _lock_timeout(conn)
        letters = conn.execute(
            query("relay", "lock-dead-letters").compose(
                table=sql.Identifier(schema, table), where=where
            ),
            params,
        ).fetchall()
        inserts: dict[str, sql.Composed] = {}
        parent = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL",
            (sql.Identifier(schema, spec.partitioned_table).as_string(conn),),
        ).fetchone()[0]
        for label, ident in letters:
            target = _target(label, spec, migrated=bool(parent))
            if target not in inserts:
                inserts[target] = _insert(conn, spec, target, table, new_id)
            row = conn.execute(inserts[target], {"source": label, "id": ident}).fetchone()
            done.append(Requeued(label, ident, str(row[0])))
            for name in (table, attempts_table):
                conn.execute(
                    query("relay", "drop-dead-letter").compose(table=sql.Identifier(schema, name)),
                    {"source": label, "id": ident},
                )
        if done:
            lowest = [int(r.new_id) for r in done if r.new_id.isdigit()]
            payload = str(min(lowest)) if lowest and len(lowest) == len(done) else "requeued"
            conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))
    return done


def _where(command: str, selection: Selection) -> tuple[sql.Composable, dict[str, Any]]:
    if selection.empty:
        raise UsageError(f"{command} needs a selection: --id, --reason, --since, --until or "
                         "--source")  # fmt: skip
    return selection.where()


def _lock_timeout(conn: Any) -> None:
    conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))


def _target(label: str, spec: OutboxSpec, *, migrated: bool) -> str:
    """The table a dead letter came from, but the partitioned table once it exists for one
    from the flat table: a switched relay no longer reads the flat table."""
    at = label.find(COPY_SUFFIX)
    source = label[:at] if at >= 0 else label
    if migrated and source == f"{spec.schema}.{spec.table}":
        return f"{spec.schema}.{spec.partitioned_table}"
    return source


def _insert(conn: Any, spec: OutboxSpec, target: str, table: str, new_id: bool) -> sql.Composed:
    """INSERT … SELECT of one dead letter (params: source, id) into `target`, each column
    cast to the target's type; RETURNING the row's id."""
    schema, _, name = target.partition(".")
    types = dict(conn.execute(
        query("relay", "requeue-columns").compose(),
        (sql.Identifier(schema, name).as_string(conn),),
    ).fetchall())  # fmt: skip
    if not types:
        raise UsageError(f"requeue: {target}, the dead letters' source table, does not exist")
    kind = {column: t.rstrip("+") for column, t in types.items()}
    metadata = [c for c in spec.metadata_columns if c in kind]
    values: dict[str, sql.Composable] = {}
    if not new_id:
        values[spec.id_column] = sql.SQL("d.id::text::{}").format(sql.SQL(kind[spec.id_column]))
    elif not types.get(spec.id_column, "").endswith("+"):
        raise UsageError(
            f"requeue --new-id: {target}.{spec.id_column} has no default or identity to draw "
            "a new id from; requeue with the same id instead"
        )
    payload = kind.get(spec.payload_column)
    if payload == "bytea":
        values[spec.payload_column] = sql.SQL(
            "coalesce(d.payload_bytes, convert_to(d.payload, 'UTF8'))"
        )
    elif payload is not None:
        values[spec.payload_column] = sql.SQL("d.payload::{}").format(sql.SQL(payload))
    for column, source in ((spec.created_column, "created_at"), (spec.key_column, "message_key"),
                           (spec.event_type_column, "event_type")):  # fmt: skip
        if column and column in kind:
            values[column] = sql.SQL("d.{}::text::{}").format(
                sql.Identifier(source), sql.SQL(kind[column])
            )
    if spec.headers_column and spec.headers_column in kind:
        values[spec.headers_column] = sql.SQL(
            "(SELECT jsonb_object_agg(p->>0, p->>1) FROM jsonb_array_elements(d.headers) p "
            "WHERE NOT p->>0 = ANY({meta}))::text::{type}"
        ).format(meta=sql.Literal(metadata), type=sql.SQL(kind[spec.headers_column]))
    for column in metadata:
        values[column] = sql.SQL(
            "(SELECT p->>1 FROM jsonb_array_elements(d.headers) p WHERE p->>0 = {name} "
            "LIMIT 1)::{type}"
        ).format(name=sql.Literal(column), type=sql.SQL(kind[column]))
    overriding = sql.SQL(" OVERRIDING SYSTEM VALUE") if not new_id else sql.SQL("")
    return query("relay", "requeue").compose(
        target=sql.Identifier(schema, name),
        columns=sql.SQL(", ").join(map(sql.Identifier, values)),
        overriding=overriding,
        values=sql.SQL(", ").join(values.values()),
        table=sql.Identifier(spec.schema, table),
        id=sql.Identifier(spec.id_column),
    )
