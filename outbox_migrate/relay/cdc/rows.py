"""Rows of the unpublished partition read back by a normal session, as the stream sends them."""

from __future__ import annotations

from typing import Any

from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.cdc import pgoutput
from outbox_migrate.relay.cdc.messages import MessageBuilder
from outbox_migrate.relay.message import Message
from outbox_migrate.sql import query


class RowReader:
    """Every column as text, built by the stream's own builder: the backlog and the mark
    repair's dead letters hold exactly what the stream would have sent."""

    def __init__(self, conn: Any, spec: OutboxSpec, columns: list[str], builder: MessageBuilder):
        names = sorted(columns)
        partition = sql.Identifier(spec.schema, spec.unpublished_partition)
        types = dict(
            conn.execute(
                "SELECT attname, atttypid::int8 FROM pg_attribute "
                "WHERE attrelid = to_regclass(%s) AND attname = ANY(%s)",
                (partition.as_string(conn), names),
            ).fetchall()
        )
        self.columns = builder.columns_for(
            pgoutput.Relation(
                0, spec.schema, "", tuple(names), tuple(int(types.get(n, 0)) for n in names)
            )
        )
        self.builder = builder
        texts = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(n)) for n in names)
        ident = sql.Identifier(spec.id_column)
        self._by_ids = query("cdc", "rows-by-ids").compose(columns=texts, table=partition, id=ident)
        self._by_ctids = query("cdc", "rows-by-ctids").compose(columns=texts, table=partition)

    def by_ids(self, conn: Any, ids: list[int]) -> list[Message]:
        """The rows with these ids, in id order (the backlog)."""
        build, columns = self.builder.message, self.columns
        return [build(columns, tuple(r)) for r in conn.execute(self._by_ids, (ids,)).fetchall()]

    def by_ctids(self, conn: Any, tids: list[str]) -> dict[str, Message]:
        """The rows at these ctids, each copy with its own content; the builder's set-aside
        for the stream is left as it was (these are being dead-lettered already)."""
        builder, columns = self.builder, self.columns
        out: dict[str, Message] = {}
        for row in conn.execute(self._by_ctids, (tids,)).fetchall():
            ident = int(row[1 + columns.id] or 0)
            saved = builder.bad.pop(ident, None)
            out[str(row[0])] = builder.message(columns, tuple(row[1:]))
            builder.bad.pop(ident, None)
            if saved is not None:
                builder.bad[ident] = saved
        return out
