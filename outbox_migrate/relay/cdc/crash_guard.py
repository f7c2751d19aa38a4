"""Whether the previous run on a slot ended without stopping: then count before publishing.

A relay killed outright (SIGKILL, the OOM killer, a crash in a broker library's C code) counts
nothing, and the message it was publishing — maybe the one that killed it — comes again from
the slot. So each run keeps one row in `<dead_letter_table>_attempts` (source `cdc-run:<slot>`,
id 0) from its start until it stops cleanly. Finding that row at a start means the last run
died: until the stream has passed the server's position at this start (everything the dead
run can have held), each message's attempt is counted *before* it is published
(`Delivery.deliver(careful=True)`), so a message that kills the relay every time reaches the
dead-letter table after `--max-attempts` restarts. A clean run pays two statements, at start
and stop; the careful window costs two short statements per batch.
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
