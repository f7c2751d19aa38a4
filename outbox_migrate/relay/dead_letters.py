"""The dead letters a team operates: list, show, requeue and purge (the `dead-letters` command).

A dead letter keeps the message as the outbox held it (relay/bad_rows.py): id, source table,
event type, key, payload (bytes too), created_at and the broker headers in order, with what
happened (attempts, each reason, deliveries before). A requeue writes it back into the table it
came from (its `source_table`, a copy label's table too; the partitioned table, once it exists,
for one from the flat table) as a new unpublished row: every column
the relay reads is filled from the dead letter — the headers column gets the header pairs that
are not metadata columns, each metadata column its own pair — so the relay sends the same
message again; with `new_id` the id column takes its default (an identity, a sequence,
`gen_random_uuid()`). The dead letter and its attempts counter go in the same transaction, so
a message is either waiting in the outbox or kept as a dead letter, never both, never neither.
Messages are written back oldest first (created_at, then id), so a key's messages keep their
order; the transaction ends with a NOTIFY on the relay's wake-up channel whose payload is the
lowest requeued id, which makes an idle relay claim from just below it at once (relay/cursor.py)
rather than at its next look below the cursor.

Statements take the caller's connection; one function, one transaction. Never waits on a lock
(`lock_timeout`): a dead letter another session is requeueing is skipped. The statements are
named in sql/relay.sql; the pieces composed into them stay here (a selection's conditions, a
requeue's value per column, each cast to the target's type): which of them appear depends on
the selection and the target table, so they are parts, not statements.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import UsageError
from outbox_migrate.sql import query

COPY_SUFFIX = " copy "
"""A second copy of an id is kept under `<source> copy N` (relay/bad_rows.py COPY_LABEL)."""
COLUMNS = (
    "source_table", "id", "event_type", "message_key", "payload", "payload_bytes", "created_at",
    "attempts", "last_error", "reasons", "delivered", "headers", "dead_at",
)  # fmt: skip
LOCK_TIMEOUT = "2s"


@dataclass(frozen=True)
class Selection:
    """Which dead letters: by id, by a reason (a substring of any reason on record), by the
    time they were dead-lettered, by source table; every given criterion must hold."""

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
    """The selected dead letters, oldest message first, each as a JSON-ready dict (the
    payload as text; `payload_bytes` as hex when the payload was raw bytes)."""
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
    selection (`UsageError`): deleting every dead letter takes saying which."""
    if selection.empty:
        raise UsageError("purge needs a selection: --id, --reason, --since, --until or --source")
    where, params = selection.where()
    with conn.transaction():
        conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
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
    """Write the selected dead letters back into their source tables as unpublished rows, and
    drop them (and their counters) from the dead-letter tables, in one transaction that ends
    with the wake-up NOTIFY (module doc). Refuses an empty selection, a source table that is
    gone, and `new_id` on a table whose id column has no default (`UsageError`)."""
    if selection.empty:
        raise UsageError("requeue needs a selection: --id, --reason, --since, --until or --source")
    schema = spec.schema
    where, params = selection.where()
    done: list[Requeued] = []
    with conn.transaction():
        conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
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


def _target(label: str, spec: OutboxSpec, *, migrated: bool) -> str:
    """Where a dead letter goes back: the table it came from (its label, schema.table, without
    a copy suffix) — but the partitioned table once it exists, for one that came from the
    flat table: the switched relay no longer reads the flat table, and the partitioned one is
    what the new version inserts into (a relay still on the flat table reaches it after its
    switch)."""
    at = label.find(COPY_SUFFIX)
    source = label[:at] if at >= 0 else label
    if migrated and source == f"{spec.schema}.{spec.table}":
        return f"{spec.schema}.{spec.partitioned_table}"
    return source


def _insert(conn: Any, spec: OutboxSpec, target: str, table: str, new_id: bool) -> sql.Composed:
    """INSERT … SELECT of one dead letter (params: source, id) into `target` (schema.table),
    each column the relay reads cast to the target's own type; RETURNING the row's id."""
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
