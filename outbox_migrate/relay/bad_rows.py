"""Failed messages, counted in the database until they are published or dead-lettered.

One policy for every way a single message can fail: the sink refused it, the relay could not
turn its row into a message (headers that are not a JSON object), the sink could not represent
it (`UnrepresentableMessage`), or the row could not be marked (a duplicate id after the swap).
Each failure adds one attempt in `<dead_letter_table>_attempts`, in the caller's transaction,
so a crash or a restart cannot reset the count and a message that makes every run fail still
reaches the dead-letter table after `max_attempts`. Shared by the polling relay and, after
merge, the CDC relay: it takes a connection and plain values, never a worker.

It runs statements inside the caller's transaction and must never commit, wait or sleep.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql

from outbox_migrate.relay import queries
from outbox_migrate.relay.message import Message, MessageId

log = logging.getLogger("outbox_migrate.relay")

ERROR_CHARS = 2000
"""A stored reason is cut to this length (a constraint's message can quote a whole row)."""
PAYLOAD_BYTES_COLUMN = "payload_bytes"
"""Dead-letter column for a raw (non-UTF-8 bytea) payload; `payload` then holds its hex text."""


@dataclass(frozen=True)
class Verdict:
    """What one round of failures led to: attempts so far per id, the messages that went to
    the dead-letter table now, the ids to try again."""

    attempts: dict[MessageId, int]
    dead: list[Message]
    retry: list[MessageId]


@dataclass
class FailedMessages:
    """Attempts and dead letters of one outbox (`schema`), shared by a relay's workers.

    `known` mirrors the ids that have a counter, so the hot path asks the database to forget
    counters only when a message that failed before went through."""

    schema: str
    dead_letter_table: str
    attempts_table: str
    max_attempts: int
    text_ids: bool
    payload_bytes: bool = False
    """The dead-letter table has a `payload_bytes` column (see `prepare`)."""
    known: set[tuple[str, MessageId]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- start --------------------------------------------------------------------------

    def prepare(self, conn: Any, sources: Iterable[str]) -> bool:
        """Create the two tables if missing (outside any batch: two relays racing on CREATE
        would otherwise fail a batch), give an existing dead-letter table a `payload_bytes`
        column when the role may, and load the ids with a counter. False: the tables cannot
        be created (no privilege) — the caller warns; a failure then stops the relay."""
        import psycopg

        for table, create in (
            (self.dead_letter_table, queries.create_dead_letter),
            (self.attempts_table, queries.create_attempts),
        ):
            # Pre-created tables need no CREATE right: `CREATE TABLE IF NOT EXISTS` checks the
            # privilege before it looks whether the table exists, so look first.
            if _exists(conn, self.schema, table):
                continue
            try:
                conn.execute(create(self.schema, table, self.text_ids))
            except (
                psycopg.errors.UniqueViolation,
                psycopg.errors.DuplicateTable,
                psycopg.errors.DuplicateObject,  # the table's row type, on some versions
            ):
                pass  # another relay process created it at the same moment
            except psycopg.errors.InsufficientPrivilege:
                return False
        self.payload_bytes = self._payload_bytes_column(conn)
        id_of = str if self.text_ids else int
        for label in sources:
            rows = conn.execute(
                queries.attempted_ids(self.schema, self.attempts_table), {"source": label}
            ).fetchall()
            self.known.update((label, id_of(r[0])) for r in rows)
        return True

    def _payload_bytes_column(self, conn: Any) -> bool:
        """Whether raw payloads can be kept as bytes. An existing table (text payload, from an
        earlier version) gets the nullable column if the role owns it — a catalog-only change,
        under a short lock timeout; otherwise raw payloads are kept as hex text, which loses
        nothing either."""
        import psycopg

        found = conn.execute(
            "SELECT 1 FROM pg_attribute WHERE attrelid = %s::regclass AND attname = %s "
            "AND NOT attisdropped",
            (sql.Identifier(self.schema, self.dead_letter_table).as_string(conn),
             PAYLOAD_BYTES_COLUMN),
        ).fetchone()  # fmt: skip
        if found:
            return True
        try:
            with conn.transaction():
                conn.execute("SET LOCAL lock_timeout = '1s'")
                conn.execute(
                    sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} bytea").format(
                        sql.Identifier(self.schema, self.dead_letter_table),
                        sql.Identifier(PAYLOAD_BYTES_COLUMN),
                    )
                )
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.LockNotAvailable) as exc:
            log.info(
                "relay.dead_letter_hex_payloads %s: raw payloads are kept as hex text",
                str(exc).splitlines()[0],
            )
            return False
        return True

    # -- in a batch's transaction ---------------------------------------------------------

    def seen_before(self, label: str, ids: Iterable[MessageId]) -> list[MessageId]:
        """The ids among `ids` that have a counter (cheap: an in-memory set)."""
        if not self.known:
            return []
        with self._lock:
            return [i for i in ids if (label, i) in self.known]

    def record(
        self, conn: Any, label: str, failed: Sequence[Message], reasons: Mapping[MessageId, str]
    ) -> Verdict:
        """Add one attempt per failed message; dead-letter those at `max_attempts` (in the
        same transaction, so their mark or removal commits with them)."""
        counted = conn.execute(
            queries.count_attempts(self.schema, self.attempts_table, self.text_ids),
            {"source": label, "ids": [m.id for m in failed],
             "errors": [reasons[m.id][:ERROR_CHARS] for m in failed]},
        ).fetchall()  # fmt: skip
        id_of = str if self.text_ids else int
        attempts = {id_of(r[0]): int(r[1]) for r in counted}
        dead = [m for m in failed if attempts[m.id] >= self.max_attempts]
        for message in dead:
            self.dead_letter(conn, label, message, attempts[message.id], reasons[message.id])
        retry = [m.id for m in failed if attempts[m.id] < self.max_attempts]
        with self._lock:
            self.known.update((label, i) for i in retry)
        self.forget(conn, label, [m.id for m in dead])
        return Verdict(attempts, dead, retry)

    def forget(self, conn: Any, label: str, ids: Sequence[MessageId]) -> None:
        """Published or dead-lettered: their counters go, in the same transaction."""
        if not ids:
            return
        with self._lock:
            for i in ids:
                self.known.discard((label, i))
        conn.execute(
            queries.forget_attempts(self.schema, self.attempts_table, self.text_ids),
            {"source": label, "ids": list(ids)},
        )

    def dead_letter(
        self, conn: Any, label: str, message: Message, attempts: int, error: str
    ) -> None:
        """Keep the message in the dead-letter table. A raw payload goes in as bytes (and as
        hex text in `payload`, which is NOT NULL in tables of earlier versions)."""
        payload = message.payload
        raw = payload if type(payload) is bytes else None
        params = {
            "source": label, "id": message.id, "event_type": message.event_type,
            "key": message.key, "payload": payload if raw is None else "\\x" + raw.hex(),
            "created_at": message.created_at, "attempts": attempts,
            "error": error[:ERROR_CHARS], "raw": raw,
        }  # fmt: skip
        conn.execute(self._insert(raw is not None), params)
        log.warning("relay.dead_lettered id=%s attempts=%d", message.id, attempts)

    def _insert(self, raw: bool) -> sql.Composed:
        if not (raw and self.payload_bytes):
            return queries.insert_dead_letter(self.schema, self.dead_letter_table)
        return sql.SQL(
            "INSERT INTO {table} (source_table, id, event_type, message_key, payload, {raw}, "
            "created_at, attempts, last_error) VALUES (%(source)s, %(id)s, %(event_type)s, "
            "%(key)s, %(payload)s, %(raw)s, %(created_at)s, %(attempts)s, %(error)s) "
            "ON CONFLICT (source_table, id) DO NOTHING"
        ).format(
            table=sql.Identifier(self.schema, self.dead_letter_table),
            raw=sql.Identifier(PAYLOAD_BYTES_COLUMN),
        )


def _exists(conn: Any, schema: str, table: str) -> bool:
    row = conn.execute(queries.table_exists(), {"schema": schema, "table": table}).fetchone()
    return bool(row and row[0])
