"""A CDC message's failed deliveries, counted in the database, and its dead-lettering.

The stream re-sends everything after the slot's confirmed position, so a counter kept in
memory starts again at every restart, reconnect or crash: a message that makes the relay crash
(or whose rejections straddle a broker outage) would be retried for ever. The counters live in
`<dead_letter_table>_attempts`, the polling relay's table (same rows, same source label), and a
message whose count reaches `max_attempts` goes to the dead-letter table with its last error.

This module only talks to the database, one short transaction per call, on a session the
caller hands in: it never waits for the broker and never holds a transaction open.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.db import one_line
from outbox_migrate.relay import queries
from outbox_migrate.relay.errors import RelayError
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.options import ATTEMPTS_TABLE_SUFFIX

log = logging.getLogger("outbox_migrate.relay")
ERROR_TEXT_MAX = 2000
"""Characters of a sink's error kept per row (the polling relay keeps as many)."""


class RejectionLedger:
    """The attempts of the messages of one source that failed at least once."""

    def __init__(self, schema: str, dead_letter_table: str, source: str, max_attempts: int):
        self.schema = schema
        self.dead_letter_table = dead_letter_table
        self.attempts_table = dead_letter_table + ATTEMPTS_TABLE_SUFFIX
        self.source = source
        self.max_attempts = max_attempts
        self.known: dict[MessageId, tuple[int, str]] = {}
        """Attempts and last error of every message with a failure on record (read at the
        start, then kept in step with the table): the stream's hot path only asks this."""
        self.available = True
        """False when the tables are missing and this role may not create them."""

    # -- start -----------------------------------------------------------------------------

    def prepare(self, conn: Any) -> None:
        """Create the two tables when missing, then read the counters a previous run left.

        The catalog is asked first: `CREATE TABLE IF NOT EXISTS` checks the CREATE privilege
        before it looks whether the table exists, so a role without CREATE must not even try
        when an administrator created the tables."""
        for table, create in (
            (self.dead_letter_table, queries.create_dead_letter),
            (self.attempts_table, queries.create_attempts),
        ):
            exists = conn.execute(queries.table_exists(), {"schema": self.schema, "table": table})
            if exists.fetchone()[0]:
                continue
            try:
                conn.execute(create(self.schema, table))
            except (
                psycopg.errors.UniqueViolation,
                psycopg.errors.DuplicateTable,
                psycopg.errors.DuplicateObject,  # the table's row type, on some versions
            ):
                pass  # another relay created it at the same moment
            except psycopg.errors.InsufficientPrivilege as exc:
                self.available = False
                log.warning(
                    "relay.dead_letter_unavailable %s: create %s and %s as in docs/relay.md; "
                    "until then a rejected message stops the relay",
                    one_line(str(exc)), self.dead_letter_table, self.attempts_table,
                )  # fmt: skip
                return
        rows = conn.execute(
            sql.SQL("SELECT id, attempts, last_error FROM {} WHERE source_table = %s").format(
                sql.Identifier(self.schema, self.attempts_table)
            ),
            (self.source,),
        ).fetchall()
        self.known = {int(r[0]): (int(r[1]), str(r[2])) for r in rows}

    # -- per batch -------------------------------------------------------------------------

    def suspect(self, message_id: MessageId) -> bool:
        """Failed before: published alone, so a crash it causes is counted against it only."""
        return message_id in self.known

    def exhausted(self, messages: Iterable[Message]) -> list[Message]:
        """Messages already at `max_attempts` (the relay crashed on their last attempt)."""
        known, most = self.known, self.max_attempts
        if not known:  # the hot path: no failure on record
            return []
        return [m for m in messages if known.get(m.id, (0, ""))[0] >= most]

    def count(self, conn: Any, errors: Mapping[MessageId, str]) -> dict[MessageId, int]:
        """Add one failed attempt per id (one statement); returns each id's attempts so far."""
        if not self.available:
            raise RelayError(
                f"the sink refused {len(errors)} message(s) and {self.attempts_table} does not "
                "exist: create it and the dead-letter table as in docs/relay.md"
            )
        ids = list(errors)
        texts = [errors[i][:ERROR_TEXT_MAX] for i in ids]
        rows = conn.execute(
            queries.count_attempts(self.schema, self.attempts_table),
            {"source": self.source, "ids": ids, "errors": texts},
        ).fetchall()
        counted: dict[MessageId, int] = {int(r[0]): int(r[1]) for r in rows}
        for i, text in zip(ids, texts, strict=True):
            self.known[i] = (counted[i], text)
        return counted

    def note(self, conn: Any, errors: Mapping[MessageId, str]) -> dict[MessageId, int]:
        """The reason of attempts counted beforehand (`count` before a careful publish);
        returns each id's attempts so far."""
        ids = list(errors)
        texts = [errors[i][:ERROR_TEXT_MAX] for i in ids]
        conn.execute(
            sql.SQL(
                "UPDATE {} AS a SET last_error = r.error, updated_at = now() "
                "FROM unnest(%(ids)s::int8[], %(errors)s::text[]) AS r(id, error) "
                "WHERE a.source_table = %(source)s AND a.id = r.id"
            ).format(sql.Identifier(self.schema, self.attempts_table)),
            {"source": self.source, "ids": ids, "errors": texts},
        )
        for i, text in zip(ids, texts, strict=True):
            self.known[i] = (self.known.get(i, (1, ""))[0], text)
        return {i: self.known[i][0] for i in ids}

    def uncount(self, conn: Any, ids: Sequence[MessageId]) -> None:
        """Take back attempts counted beforehand that never reached the message (the broker
        was unavailable: not the message's fault)."""
        table = sql.Identifier(self.schema, self.attempts_table)
        with conn.transaction():
            rows = conn.execute(
                sql.SQL(
                    "UPDATE {} SET attempts = attempts - 1 WHERE source_table = %(source)s "
                    "AND id = ANY(%(ids)s::int8[]) RETURNING id, attempts"
                ).format(table),
                {"source": self.source, "ids": list(ids)},
            ).fetchall()
            gone = [int(r[0]) for r in rows if int(r[1]) <= 0]
            if gone:
                self._forget(conn, list(gone))
        for r in rows:
            i = int(r[0])
            if i in self.known and int(r[1]) > 0:
                self.known[i] = (int(r[1]), self.known[i][1])

    def dead_letter(self, conn: Any, messages: Sequence[Message]) -> None:
        """Keep the messages in the dead-letter table and drop their counters, together."""
        insert = queries.insert_dead_letter(self.schema, self.dead_letter_table)
        with conn.transaction():
            for m in messages:
                attempts, error = self.known.get(m.id, (self.max_attempts, ""))
                conn.execute(
                    insert,
                    {"source": self.source, "id": m.id, "event_type": m.event_type,
                     "key": m.key, "payload": m.payload, "created_at": m.created_at,
                     "attempts": attempts, "error": error},
                )  # fmt: skip
            self._forget(conn, [m.id for m in messages])

    def forget(self, conn: Any, ids: Sequence[MessageId]) -> None:
        """Published after all: the counters go (only ids with a failure on record)."""
        mine = [i for i in ids if i in self.known]
        if mine:
            with conn.transaction():
                self._forget(conn, mine)

    def _forget(self, conn: Any, ids: list[MessageId]) -> None:
        conn.execute(
            queries.forget_attempts(self.schema, self.attempts_table),
            {"source": self.source, "ids": ids},
        )
        for i in ids:
            self.known.pop(i, None)
