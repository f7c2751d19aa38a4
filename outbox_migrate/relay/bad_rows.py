"""Attempts and dead letters of failed messages, one policy for the polling and CDC relays
(docs/relay.md, "Failures" and "Bad rows"). A sink crash counts against the messages it held
(uncounted, one bad message would stop the outbox on every restart); `SinkUnavailable` never
counts. Every statement on the two tables is here; nothing here commits, waits or sleeps.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql

from outbox_migrate.db import one_line
from outbox_migrate.errors import RelayFailed
from outbox_migrate.patterns.kinds.dead_letter_tables import (
    create_attempts,
    create_dead_letter,
    id_sql_type,
)
from outbox_migrate.relay import queries
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.sql import query

log = logging.getLogger("outbox_migrate.relay")

ERROR_CHARS = 2000
"""A stored reason is cut to this length (a constraint's message can quote a whole row)."""
COPY_LABEL = "{source} copy {n}"
"""`source_table` of a second (third, …) copy of an id whose dead letter is taken."""
MAX_COPIES = 1000
PAYLOAD_BYTES_COLUMN = "payload_bytes"
"""Dead-letter column for a raw (non-UTF-8 bytea) payload; `payload` then holds its hex text."""


DEAD_LETTER_COLUMNS: dict[str, str] = {
    "source_table": "text", "id": "", "event_type": "text", "message_key": "text",
    "payload": "text", "payload_bytes": "bytea", "created_at": "timestamp with time zone",
    "attempts": "integer", "last_error": "text", "dead_at": "timestamp with time zone",
    "headers": "jsonb", "reasons": "text[]", "delivered": "integer",
}  # fmt: skip
"""What the relay writes to a dead-letter table, by column, and its type ("": the ids')."""
ATTEMPTS_COLUMNS: dict[str, str] = {
    "source_table": "text", "id": "", "attempts": "integer", "last_error": "text",
    "updated_at": "timestamp with time zone", "reasons": "text[]", "delivered": "integer",
}  # fmt: skip
ADDED_COLUMNS: dict[str, str] = {
    "headers": "jsonb", "reasons": "text[] NOT NULL DEFAULT '{}'",
    "delivered": "int NOT NULL DEFAULT 0", "payload_bytes": "bytea",
}  # fmt: skip
"""Columns a table made by an earlier version may lack, as `ADD COLUMN` declares them."""
HISTORY_COLUMNS: dict[str, str] = {
    "headers": "%(headers)s::jsonb", "reasons": "%(reasons)s::text[]",
    "delivered": "%(delivered)s",
}  # fmt: skip
"""Dead-letter columns an earlier version's table may lack, and the values they take."""
REASONS_KEPT = 20
"""An attempts row keeps the last this many reasons (a crash loop must not grow it for ever)."""

__all__ = ["PAYLOAD_BYTES_COLUMN", "DeadLetter", "FailedMessages", "Verdict", "log_dead"]


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter written in the caller's transaction (a fact once that commits)."""

    message: Message
    attempts: int
    kept_as: str
    """The `source_table` it is kept under (a copy label when the source's key was taken)."""
    label: str
    error: str = ""
    reasons: tuple[str, ...] = ()
    delivered: int = 0


@dataclass(frozen=True)
class Verdict:
    """One round of failures (`FailedMessages.record`)."""

    attempts: dict[MessageId, int]
    dead: list[Message]
    retry: list[MessageId]
    letters: list[DeadLetter] = field(default_factory=list)


def log_dead(letters: Sequence[DeadLetter]) -> None:
    """Log dead letters whose transaction committed: never before, it may roll back."""
    for d in letters:
        copy = "" if d.kept_as == d.label else f" as={d.kept_as!r}"
        log.warning("relay.dead_lettered id=%s attempts=%d%s", d.message.id, d.attempts, copy)


@dataclass
class FailedMessages:
    """Attempts and dead letters of one outbox, shared by a relay's workers. `known` mirrors
    the counters on record: the hot path needs no statement for messages without one."""

    schema: str
    dead_letter_table: str
    attempts_table: str
    max_attempts: int
    text_ids: bool
    payload_bytes: bool = False
    available: bool = True
    """False when this role may not create or write the tables (`unavailable` says why)."""
    unavailable: str = ""
    extras: frozenset[str] = frozenset(HISTORY_COLUMNS)
    """The dead-letter table's later columns (headers, reasons, delivered) it has."""
    kept_history: bool = True
    """The attempts table keeps reasons and deliveries (an earlier version's may not)."""
    known: dict[tuple[str, MessageId], tuple[int, str]] = field(default_factory=dict)
    history: dict[tuple[str, MessageId], tuple[list[str], int]] = field(default_factory=dict)
    """Per counter: its reasons on record and how many attempts followed a delivery."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- start --------------------------------------------------------------------------

    def prepare(self, conn: Any, sources: Iterable[str]) -> bool:
        """Create the tables if missing (outside any batch: relays racing on CREATE would
        fail it), check their columns, load the counters. False: not usable."""
        import psycopg

        for table, create in (
            (self.dead_letter_table, create_dead_letter),
            (self.attempts_table, create_attempts),
        ):
            # `CREATE TABLE IF NOT EXISTS` checks the privilege first: look first.
            found = conn.execute(
                queries.named("table-exists"), {"schema": self.schema, "table": table}
            ).fetchone()
            if found and found[0]:
                continue
            try:
                conn.execute(create(self.schema, table, self.text_ids))
            except (
                psycopg.errors.UniqueViolation,
                psycopg.errors.DuplicateTable,
                psycopg.errors.DuplicateObject,  # the table's row type, on some versions
            ):
                pass  # another relay process created it at the same moment
            except psycopg.errors.InsufficientPrivilege as exc:
                self.available = False
                log.warning(
                    "relay.dead_letter_unavailable %s: create %s and %s as in docs/relay.md; "
                    "until then a failed message stops the relay",
                    one_line(str(exc)), self.dead_letter_table, self.attempts_table,
                )  # fmt: skip
                return False
        missing = self._missing_privileges(conn)
        if missing:
            self.available = False
            self.unavailable = f"{conn.info.user} lacks {missing}: GRANT it (as in docs/relay.md)"
            log.warning("relay.dead_letter_unavailable %s; until then a failed message stops "
                        "the relay", self.unavailable)  # fmt: skip
            return False
        lacking = self._check_columns(conn, self.dead_letter_table, DEAD_LETTER_COLUMNS)
        self.extras = frozenset(c for c in HISTORY_COLUMNS if c not in lacking)
        self.kept_history = not self._check_columns(conn, self.attempts_table, ATTEMPTS_COLUMNS)
        self.payload_bytes = self._payload_bytes_column(conn)
        id_of = self._id_of
        for label in sources:
            rows = conn.execute(self._sql("attempted"), {"source": label}).fetchall()
            self.known.update(((label, id_of(r[0])), (int(r[1]), str(r[2]))) for r in rows)
            self.history.update(((label, id_of(r[0])), (list(r[3] or []), int(r[4])))
                                for r in rows)  # fmt: skip
        return True

    def _missing_privileges(self, conn: Any) -> str:
        """What this role may not do on the tables: said at start, not at the first bad row."""
        wanted = ((self.dead_letter_table, ("SELECT", "INSERT")),
                  (self.attempts_table, ("SELECT", "INSERT", "UPDATE", "DELETE")))  # fmt: skip
        missing = []
        for table, privileges in wanted:
            name = sql.Identifier(self.schema, table).as_string(conn)
            for privilege in privileges:
                row = conn.execute("SELECT has_table_privilege(%s, %s)", (name, privilege))
                if not row.fetchone()[0]:
                    missing.append(f"{privilege} on {name}")
        return ", ".join(missing)

    def _check_columns(self, conn: Any, table: str, wanted: Mapping[str, str]) -> set[str]:
        """Refuse to start on a table without the id type or columns the relay needs (not
        at the first bad row, on every restart); add the later optional columns where the role
        may, else warn. Returns those still missing."""
        name = sql.Identifier(self.schema, table).as_string(conn)
        columns_of = query("relay", "columns-of").compose(reg=sql.Literal(name))
        found = dict(conn.execute(columns_of).fetchall())
        id_type = "text" if self.text_ids else "bigint"
        have = found.get("id")
        if have is not None and have != id_type:
            raise RelayFailed(
                f"{name}.id is {have} but this outbox's ids are {id_type}: "
                f"ALTER TABLE {name} ALTER COLUMN id TYPE {id_type} (docs/relay.md)"
            )
        missing = [c for c in wanted if c not in found and c != PAYLOAD_BYTES_COLUMN]
        unfixable = [c for c in missing if c not in ADDED_COLUMNS]
        if unfixable:
            raise RelayFailed(
                f"{name} lacks column(s) {', '.join(unfixable)}: drop it (once empty) and let "
                "the migration or the relay create it, as in docs/relay.md"
            )
        if not missing:
            return set()  # payload_bytes is optional (`_payload_bytes_column`)
        alter = f"ALTER TABLE {name} " + ", ".join(
            f"ADD COLUMN IF NOT EXISTS {c} {ADDED_COLUMNS[c]}" for c in missing
        )
        exc = _alter(conn, alter)
        if exc is not None:
            log.warning(
                "relay.dead_letter_columns_missing %s lacks %s (%s): dead letters are kept "
                "without them; as its owner: %s",
                name, ", ".join(missing), one_line(str(exc)), alter,
            )  # fmt: skip
            return set(missing)
        return set()

    def _payload_bytes_column(self, conn: Any) -> bool:
        """Whether raw payloads can be kept as bytes (else as hex text, which loses nothing)."""
        found = conn.execute(
            "SELECT 1 FROM pg_attribute WHERE attrelid = %s::regclass AND attname = %s "
            "AND NOT attisdropped",
            (sql.Identifier(self.schema, self.dead_letter_table).as_string(conn),
             PAYLOAD_BYTES_COLUMN),
        ).fetchone()  # fmt: skip
        if found:
            return True
        exc = _alter(
            conn,
            sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} bytea").format(
                sql.Identifier(self.schema, self.dead_letter_table),
                sql.Identifier(PAYLOAD_BYTES_COLUMN),
            ),
        )
        if exc is not None:
            log.info(
                "relay.dead_letter_hex_payloads %s: raw payloads are kept as hex text",
                str(exc).splitlines()[0],
            )
            return False
        return True

    # -- in memory (the hot path) ---------------------------------------------------------

    def seen_before(self, label: str, ids: Sequence[MessageId]) -> list[MessageId]:
        """The ids among `ids` that have a counter (asked for every batch while any is known)."""
        if not self.known:
            return []
        with self._lock:
            mine = {i for source, i in self.known if source == label}
        return [i for i in ids if i in mine] if mine else []

    def exhausted(self, label: str, messages: Sequence[Message]) -> list[Message]:
        """Messages at `max_attempts` (a crash counted their last one): dead-letter, not send."""
        if not self.known:
            return []
        most = self.max_attempts
        with self._lock:
            worn = {
                i for (source, i), (n, _) in self.known.items() if source == label and n >= most
            }
        return [m for m in messages if m.id in worn] if worn else []

    # -- in the caller's transaction -------------------------------------------------------

    def count(
        self,
        conn: Any,
        label: str,
        reasons: Mapping[MessageId, str],
        *,
        delivered: bool = False,
    ) -> dict[MessageId, int]:
        """Add one attempt per id (copies of an id share one); returns each id's attempts.
        `delivered`: the sink had acknowledged these messages (their mark failed)."""
        if not reasons:
            return {}
        if not self.available:
            raise RelayFailed(
                f"{len(reasons)} message(s) failed and cannot be counted or dead-lettered: "
                + (self.unavailable or f"{self.attempts_table} does not exist: create it and "
                   f"{self.dead_letter_table} as in docs/relay.md")
            )  # fmt: skip
        ids = list(reasons)
        errors = [reasons[i][:ERROR_CHARS] for i in ids]
        # Each id once: an upsert cannot touch one row twice (21000).
        statement = (
            self._sql("count-attempts", kept=sql.Literal(REASONS_KEPT))
            if self.kept_history
            else self._sql("count-attempts-without-history")
        )
        rows = conn.execute(
            statement,
            {"source": label, "ids": ids, "errors": errors, "delivered": int(delivered)},
        ).fetchall()
        return self._counted(label, rows, dict(zip(ids, errors, strict=True)))

    def note(self, conn: Any, label: str, reasons: Mapping[MessageId, str]) -> dict[MessageId, int]:
        """The reason of attempts counted beforehand (CDC's careful publish); returns each
        id's attempts."""
        ids = list(reasons)
        errors = [reasons[i][:ERROR_CHARS] for i in ids]
        # The careful count's placeholder reason is replaced.
        reasons_set = ", reasons = a.reasons[:cardinality(a.reasons) - 1] || r.error"
        statement = self._sql(
            "note-attempts",
            reasons=sql.SQL(reasons_set if self.kept_history else ""),
            history=self._history("a."),
        )
        rows = conn.execute(statement, {"source": label, "ids": ids, "errors": errors}).fetchall()
        attempts = self._counted(label, rows, dict(zip(ids, errors, strict=True)))
        missing = {i: reasons[i] for i in ids if i not in attempts}
        if missing:
            attempts.update(self.count(conn, label, missing))
        return attempts

    def uncount(self, conn: Any, label: str, ids: Sequence[MessageId]) -> None:
        """Take back attempts counted beforehand that never reached the messages (the broker
        was unavailable: not the messages' fault); a counter back at zero goes."""
        rows = conn.execute(
            self._sql("uncount-attempts"), {"source": label, "ids": list(ids)}
        ).fetchall()
        id_of = self._id_of
        gone = [id_of(r[0]) for r in rows if int(r[1]) <= 0]
        with self._lock:
            for r in rows:
                key = (label, id_of(r[0]))
                if key in self.known and int(r[1]) > 0:
                    self.known[key] = (int(r[1]), self.known[key][1])
        self.forget(conn, label, gone)

    def record(
        self,
        conn: Any,
        label: str,
        failed: Sequence[Message],
        reasons: Mapping[MessageId, str],
        *,
        counted: bool = False,
        keep: Collection[MessageId] = (),
        delivered: bool = False,
        now: bool = False,
    ) -> Verdict:
        """Add one attempt per failed id (`counted`: only the reason is new); dead-letter
        each copy at `max_attempts` (`now`: whatever its attempts) in the same transaction as
        its mark or removal. `keep`: counters that stay, another copy being unsettled."""
        if counted:
            attempts = self.note(conn, label, reasons)
        else:
            attempts = self.count(conn, label, reasons, delivered=delivered)
        most = self.max_attempts
        dead = list(failed) if now else [m for m in failed if attempts[m.id] >= most]
        letters = [
            self.dead_letter(conn, label, message, attempts[message.id], reasons[message.id])
            for message in dead
        ]
        retry = [i for i in attempts if attempts[i] < most]
        self.forget(conn, label, [i for i in {m.id: 0 for m in dead} if i not in keep])
        return Verdict(attempts, dead, retry, letters)

    def dead_letter_exhausted(
        self, conn: Any, label: str, messages: Sequence[Message]
    ) -> list[DeadLetter]:
        """Dead-letter what `exhausted` found if the database agrees (another process may
        have settled them since)."""
        ids = list({m.id: 0 for m in messages})
        rows = conn.execute(self._sql("attempts-of"), {"source": label, "ids": ids}).fetchall()
        on_record = {self._id_of(r[0]): (int(r[1]), str(r[2])) for r in rows}
        with self._lock:
            self.history.update(((label, self._id_of(r[0])), (list(r[3] or []), int(r[4])))
                                for r in rows)  # fmt: skip
            for i in ids:
                if i in on_record:
                    self.known[(label, i)] = on_record[i]
                else:
                    self.known.pop((label, i), None)
        dead = [m for m in messages if on_record.get(m.id, (0, ""))[0] >= self.max_attempts]
        letters = [self.dead_letter(conn, label, m, *on_record[m.id]) for m in dead]
        self.forget(conn, label, list({m.id: 0 for m in dead}))
        return letters

    def forget(self, conn: Any, label: str, ids: Sequence[MessageId]) -> None:
        """Published or dead-lettered: their counters go, in the same transaction."""
        if not ids:
            return
        with self._lock:
            for i in ids:
                self.known.pop((label, i), None)
                self.history.pop((label, i), None)
        conn.execute(self._sql("forget-attempts"), {"source": label, "ids": list(ids)})

    def rewrite(self, conn: Any, letter: DeadLetter) -> DeadLetter:
        """Write again a dead letter whose transaction rolled back, as it was."""
        history = (list(letter.reasons), letter.delivered)
        return self.dead_letter(conn, letter.label, letter.message, letter.attempts,
                                letter.error, history=history)  # fmt: skip

    def dead_letter(
        self,
        conn: Any,
        label: str,
        message: Message,
        attempts: int,
        error: str,
        *,
        history: tuple[list[str], int] | None = None,
    ) -> DeadLetter:
        """Keep the message in the dead-letter table with its headers, reasons and
        deliveries. A raw payload goes in as bytes and as hex text (`payload` may be NOT
        NULL). Never a silent no-op: a taken key moves it to a copy label."""
        payload = message.payload
        raw = payload if type(payload) is bytes else None
        error = error[:ERROR_CHARS]
        if history is None:
            with self._lock:
                history = self.history.get((label, message.id), ([], 0))
        reasons, delivered = history
        if not reasons or reasons[-1] != error:
            reasons = [*reasons, error]
        params = {
            "source": label, "id": message.id, "event_type": message.event_type,
            "key": message.key, "payload": payload if raw is None else "\\x" + raw.hex(),
            "created_at": message.created_at, "attempts": attempts,
            "error": error, "raw": raw,
            "headers": json.dumps([list(pair) for pair in message.extra_headers]),
            "reasons": reasons, "delivered": delivered,
        }  # fmt: skip
        # The payload is an untyped parameter, so an older json table still takes it.
        names = [PAYLOAD_BYTES_COLUMN] if raw is not None and self.payload_bytes else []
        values = ["%(raw)s"] if names else []
        for column, value in HISTORY_COLUMNS.items():
            if column in self.extras:
                names.append(column)
                values.append(value)
        insert = self._sql(
            "insert-dead-letter", self.dead_letter_table,
            columns=sql.SQL("").join(sql.SQL(", {}").format(sql.Identifier(n)) for n in names),
            values=sql.SQL("").join(sql.SQL(", " + v) for v in values),
        )  # fmt: skip
        written = conn.execute(insert, params).fetchone()
        kept = label if written else self._as_copy(conn, insert, params)
        return DeadLetter(message, attempts, kept, label, error, tuple(reasons), delivered)

    def _as_copy(self, conn: Any, insert: sql.Composed, params: dict[str, Any]) -> str:
        """(source, id) holds a dead letter already: this very message (return its label), or
        another copy of the id (keep this one under the first free copy label)."""
        label = params["source"]
        prefix = COPY_LABEL.format(source=label, n="")
        rows = conn.execute(
            self._sql("dead-letters-of", self.dead_letter_table), {**params, "copies": prefix}
        ).fetchall()
        same = [str(r[0]) for r in rows if r[1]]
        if same:
            return same[0]
        taken = {str(r[0]) for r in rows}
        for n in range(2, MAX_COPIES):
            copy = COPY_LABEL.format(source=label, n=n)
            if copy not in taken and conn.execute(insert, {**params, "source": copy}).fetchone():
                return copy
        raise RelayFailed(f"{MAX_COPIES} dead letters of id {params['id']} in {label}: no room")

    # -- helpers ---------------------------------------------------------------------------

    def _sql(self, name: str, table: str = "", **parts: sql.Composable) -> sql.Composed:
        return query("relay", name).compose(
            table=sql.Identifier(self.schema, table or self.attempts_table),
            id_type=id_sql_type(self.text_ids), **{"history": self._history(), **parts},
        )  # fmt: skip

    def _history(self, alias: str = "") -> sql.SQL:
        """The reasons and deliveries columns, or stand-ins where an older table lacks them."""
        if not self.kept_history:
            return sql.SQL("NULL::text[], 0")
        return sql.SQL(f"{alias}reasons, {alias}delivered")

    def _id_of(self, value: Any) -> MessageId:
        return str(value) if self.text_ids else int(value)

    def _counted(
        self, label: str, rows: Sequence[Any], errors: Mapping[MessageId, str]
    ) -> dict[MessageId, int]:
        id_of = self._id_of
        attempts = {id_of(r[0]): int(r[1]) for r in rows}
        with self._lock:
            self.known.update(((label, i), (n, errors[i])) for i, n in attempts.items())
            if rows and len(rows[0]) > 3:
                self.history.update(((label, id_of(r[0])), (list(r[2] or []), int(r[3])))
                                    for r in rows)  # fmt: skip
        return attempts


def _alter(conn: Any, statement: Any) -> Exception | None:
    """Run an ALTER under a 1 s lock timeout; returns the refusal, if any."""
    import psycopg

    try:
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '1s'")
            conn.execute(statement)
    except (psycopg.errors.InsufficientPrivilege, psycopg.errors.LockNotAvailable) as exc:
        return exc
    return None
