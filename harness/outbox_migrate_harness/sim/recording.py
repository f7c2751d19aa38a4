"""The recording sink: every published message lands, one row per delivery, in a table in a
separate database (docs/demo.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from outbox_migrate.relay.message import Message

TABLE = "received"


def create(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        conn.execute(
            f"CREATE TABLE {TABLE} (delivery bigint GENERATED ALWAYS AS IDENTITY, "
            "message_key text NOT NULL, outbox_id text NOT NULL, source text NOT NULL, "
            "relay text NOT NULL, created_at timestamptz NOT NULL, "
            "received_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )


class RecordingSink:
    name = "recording"

    def __init__(self, dsn: str, relay: str, *, identity: str = "key") -> None:
        self.relay = relay
        self.by_id = identity == "id"
        """Record a delivery under the outbox id (as text) instead of the message key."""
        self.conn = psycopg.connect(dsn, autocommit=True, application_name="demo-recorder")

    def publish(self, batch: Sequence[Message]) -> None:
        with (
            self.conn.cursor() as cur,
            cur.copy(
                f"COPY {TABLE} (message_key, outbox_id, source, relay, created_at) FROM STDIN"
            ) as copy,
        ):
            for message in batch:
                key = str(message.id) if self.by_id else (message.key or "")
                copy.write_row((key, str(message.id), message.table, self.relay, message.created))

    def close(self) -> None:
        self.conn.close()


def received(dsn: str) -> dict[str, Any]:
    """Per-key deliveries and the receipt timeline (for gaps and lag)."""
    with psycopg.connect(dsn) as conn:
        counts: dict[str, int] = dict(
            conn.execute(f"SELECT message_key, count(*) FROM {TABLE} GROUP BY 1").fetchall()
        )
        timeline = conn.execute(
            f"SELECT extract(epoch FROM received_at), "
            f"extract(epoch FROM received_at - created_at) FROM {TABLE} ORDER BY received_at"
        ).fetchall()
    return {"counts": counts, "timeline": [(float(a), float(b)) for a, b in timeline]}
