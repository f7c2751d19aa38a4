"""Whether the previous run on a slot ended without stopping: then count before publishing.

A relay killed outright counts nothing, and the message that maybe killed it comes again. So
each run keeps one row in the attempts table from its start until it stops cleanly; finding it
at a start means the last run died, and until the stream passes this start's position each
attempt is counted *before* the publish (`Delivery.deliver(careful=True)`): a message that
kills the relay every time is dead-lettered after `--max-attempts` restarts.
"""

from __future__ import annotations

from typing import Any

from psycopg import sql

from outbox_migrate.sql import query

RUN_SOURCE = "cdc-run:{slot}"
"""`source_table` of a run's row; never a table's label (those are `schema.table`)."""


class RunMarker:
    """The row that says a CDC relay is running on `slot`."""

    def __init__(self, schema: str, attempts_table: str, slot: str) -> None:
        self.table = sql.Identifier(schema, attempts_table)
        self.source = RUN_SOURCE.format(slot=slot)

    def begin(self, conn: Any) -> bool:
        """Record this run; True when the row was there already (the last run died)."""
        row = conn.execute(
            query("cdc", "begin-run").compose(table=self.table), (self.source,)
        ).fetchone()
        return bool(row) and int(row[0]) > 1

    def end(self, conn: Any) -> None:
        """The run stopped cleanly: the next one need not be careful."""
        conn.execute(query("cdc", "end-run").compose(table=self.table), (self.source,))
