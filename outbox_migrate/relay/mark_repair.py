"""A mark that broke a constraint: find the rows at fault, mark the rest (docs/relay.md, "Bad
rows"). Never waits on a lock (`SKIP LOCKED`: a row another relay holds is its business);
each statement is several commands in one simple query, for one round trip.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.db import one_line
from outbox_migrate.errors import RelayFailed
from outbox_migrate.patterns import marker
from outbox_migrate.relay import queries
from outbox_migrate.relay.bad_rows import DeadLetter, FailedMessages
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.parking import Parking
from outbox_migrate.sql import query

_KEY_COLUMN = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod)
FROM pg_index i
JOIN pg_class ic ON ic.oid = i.indexrelid
JOIN pg_class tc ON tc.oid = i.indrelid
JOIN pg_namespace n ON n.oid = tc.relnamespace
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
WHERE n.nspname = %s AND tc.relname = %s AND ic.relname = %s AND ic.relnamespace = n.oid
  AND i.indisunique AND i.indnkeyatts = 1 AND i.indexprs IS NULL AND i.indpred IS NULL
  AND has_table_privilege(tc.oid, 'SELECT')
"""


@dataclass(frozen=True)
class ConflictKey:
    """A unique index on the id of the table a mark moves rows into. The error names it in
    every language (its detail names only the first row, in English)."""

    schema: str
    table: str
    index: str
    column: str
    type_sql: str

    def lookup(self, ids: list[MessageId], text_ids: bool) -> sql.Composed:
        """The ids the table holds, through its index whatever the statistics say (a
        partition analyzed when small would be seq-scanned); rows in the second result."""
        column = sql.Identifier(self.column)
        return sql.SQL(
            "SET LOCAL enable_seqscan = off; "
            "SELECT {out} FROM {table} WHERE {column} = ANY({ids}::{type}[]); "
            "SET LOCAL enable_seqscan = on"
        ).format(
            out=sql.SQL("{}::text").format(column) if text_ids else column,
            table=sql.Identifier(self.schema, self.table),
            column=column,
            # A hand-made literal: adapting a list of ints costs more than the lookup.
            ids=sql.Literal([str(i) for i in ids] if text_ids else _int_array(ids)),
            type=sql.SQL(self.type_sql),
        )

    def taken(self, conn: Any, ids: list[MessageId], text_ids: bool) -> set[MessageId]:
        if not ids:
            return set()
        return taken_rows(conn.execute(self.lookup(ids, text_ids)))

    def reason(self, ident: MessageId) -> str:
        return (
            f'SQLSTATE 23505: duplicate key value violates unique constraint "{self.index}" '
            f"(Key ({self.column})=({ident}) already exists in {self.schema}.{self.table}.)"
        )


def table_fault(error: BaseException | None, source: queries.Source) -> RelayFailed | None:
    """The relay's stop when a mark failed for the table, not for a row: no partition takes a
    published row (SQLSTATE 23514 without a constraint name, in any server language: a CHECK
    always names its constraint). Repairing would split the batch down to single rows, all
    failing alike, and dead-letter the whole backlog after sending it once per try."""
    if not isinstance(error, psycopg.errors.CheckViolation) or error.diag.constraint_name:
        return None
    return RelayFailed(
        f"relay stopped: {source.mark_table} has no partition for published rows, so no row "
        f"can be marked ({one_line(str(error))}); COPRA publishes from the partitioned table "
        "only from V4 on: run the relay with --mode flat until then"
    )


def of_error(conn: Any, error: psycopg.Error | None, id_column: str) -> ConflictKey | None:
    if error is None or error.sqlstate != "23505":
        return None
    diag = error.diag
    schema, table, index = diag.schema_name, diag.table_name, diag.constraint_name
    if not (schema and table and index):
        return None
    row = conn.execute(_KEY_COLUMN, (schema, table, index)).fetchone()
    if row is None or row[0] != id_column:
        return None
    return ConflictKey(schema, table, index, row[0], row[1])


def taken_rows(cursor: Any) -> set[MessageId]:
    cursor.nextset()
    while cursor.description is None:
        if not cursor.nextset():
            raise RuntimeError("a conflict-key lookup returned no rows result")  # a bug
    return {r[0] for r in cursor.fetchall()}


def _int_array(ids: list[MessageId]) -> str:
    return "{" + ",".join(str(int(i)) for i in ids) + "}"


@dataclass
class Repaired:
    marked: int = 0
    bad: dict[MessageId, str] = field(default_factory=dict)
    letters: list[DeadLetter] = field(default_factory=list)
    retry: list[MessageId] = field(default_factory=list)
    attempts: dict[MessageId, int] = field(default_factory=dict)
    held: set[MessageId] = field(default_factory=set)
    """With key ordering: rows after a bad row of its key, left unmarked (sent again later)."""


class Suspects:
    """Rows whose mark failed, tried alone before a later batch's mark; shared by workers."""

    def __init__(self) -> None:
        self._ids: set[tuple[str, MessageId]] = set()
        self._lock = threading.Lock()
        self._keys: dict[str, ConflictKey] = {}
        """Per source: the unique key on the id its marks broke (`ConflictKey`)."""

    def key(self, label: str) -> ConflictKey | None:
        return self._keys.get(label)

    def learn(self, label: str, key: ConflictKey) -> None:
        self._keys[label] = key  # one assignment: atomic under the GIL

    def __bool__(self) -> bool:
        return bool(self._ids)

    def among(self, label: str, ids: Sequence[MessageId]) -> set[MessageId]:
        with self._lock:
            mine = {i for source, i in self._ids if source == label}
        return {i for i in ids if i in mine} if mine else set()

    def update(self, label: str, add: Sequence[MessageId], drop: Sequence[MessageId]) -> None:
        with self._lock:
            self._ids.update((label, i) for i in add)
            self._ids.difference_update((label, i) for i in drop)


def repair(
    conn: Any,
    source: queries.Source,
    failures: FailedMessages,
    suspects: Suspects,
    rows: Sequence[Any],
    batch: Sequence[Message],
    acked: Sequence[MessageId],
    error: psycopg.Error | None = None,
    *,
    by_key: bool = False,
) -> Repaired:
    """Mark the acknowledged rows of a batch whose mark failed (`error`, when known); count
    the rows at fault. `by_key`: rows after a bad row of their key are not marked either."""
    wanted = set(acked)
    by_id = {m.id: m for m in batch}
    tids = {r[queries.CLAIM_CTID_COLUMN]: r[0] for r in rows if r[0] in wanted}
    done = Repaired()
    if not tids:
        return done
    with conn.transaction():
        key = suspects.key(source.label)
        if key is None:
            key = of_error(conn, error, source.id_column)
            if key is not None:
                suspects.learn(source.label, key)
        # One round trip: lock, key lookup, deferred constraints immediate (at COMMIT they
        # would fail all rows again), and the savepoint a key-ordered repair goes back to.
        cursor = conn.execute(_lock(source, tids, key))
        locked = cursor.fetchall()
        # Same ctid and id, still unpublished: the row the batch claimed (in claim order).
        same = {tid for tid, ident in locked if tids.get(tid) == _id_of(source, ident)}
        todo = [tid for tid in tids if tid in same]
        taken = None
        if key is not None:
            ids = taken_rows(cursor)
            taken = {tid for tid in todo if tids[tid] in ids}
        failed = _mark_named_first(conn, source, todo, tids, taken, key)
        if failed is None:
            # The whole batch failed already: `mark_in_halves` starts with its halves.
            failed = mark_in_halves(conn, source, todo)
        if by_key and failed:
            done.held = _behind_bad_keys(batch, {tids[tid] for tid in failed})
            if done.held:
                # Marked already: undo, and mark the rest without them.
                conn.execute(_ROLLBACK_TO_OUTER)
                todo = [tid for tid in todo if tid not in failed and tids[tid] not in done.held]
                failed.update(mark_in_halves(conn, source, todo))
                todo += [tid for tid in failed if tid not in todo]
        done.marked = len(todo) - len(failed)
        marked = [tids[tid] for tid in todo if tid not in failed]
        failures.forget(conn, source.label, failures.seen_before(source.label, marked))
        if failed:
            _count(conn, source, failures, suspects, failed, tids, by_id, done)
    return done


def settle_dead(
    conn: Any, source: queries.Source, rows: Sequence[Any], dead: Collection[MessageId]
) -> None:
    """Take dead-lettered rows out of the unpublished partition, in the transaction that
    wrote their dead letters, before the batch's mark (whose failure would roll them back).
    Deleted, not marked: in the published partition a requeue of its id would meet it."""
    wanted = set(dead)
    at = queries.CLAIM_CTID_COLUMN
    _settle_tids(conn, source, [r[at] for r in rows if r[0] in wanted])


def _settle_tids(conn: Any, source: queries.Source, tids: list[str]) -> None:
    """Delete these rows; mark those a DELETE cannot remove; stop when neither works."""
    if not tids:
        return
    gone, refused = _delete_dead(conn, source, tids)
    left = [tid for tid in tids if tid not in gone]
    failed = mark_in_halves(conn, source, left) if left else {}
    if failed:
        raise _neither(source, failed, refused)


def settle_dead_ids(conn: Any, source: queries.Source, dead: Collection[MessageId]) -> None:
    """`settle_dead` for a relay that knows its messages by id, not by ctid (CDC): the
    unpublished rows of those ids, locked skipping any another session holds (that one
    settles them), go the same way, in the transaction that wrote their dead letters.
    Marked instead, as CDC did, a dead-lettered row sat in the published partition, and its
    requeue made a second row of that id there."""
    ids = list(dict.fromkeys(dead))
    if not ids:
        return
    ident = sql.Identifier(source.id_column)
    locked = conn.execute(
        query("cdc", "repair-lock").compose(
            table=source.claim_ident, id=ident, same=source.same_relation(),
            locking=sql.SQL(" ORDER BY {}, ctid FOR UPDATE SKIP LOCKED").format(ident),
        ),
        {"ids": ids},
    ).fetchall()  # fmt: skip
    _settle_tids(conn, source, [str(row[0]) for row in locked])


def redo_dead(
    conn: Any,
    source: queries.Source,
    failures: FailedMessages,
    rows: Sequence[Any],
    letters: Sequence[DeadLetter],
) -> list[DeadLetter]:
    """Write again, in a transaction of their own, dead letters that rolled back with their
    batch's mark, and settle their rows; a row gone or locked elsewhere is not written."""
    ids = {d.message.id for d in letters}
    tids = {r[queries.CLAIM_CTID_COLUMN]: r[0] for r in rows if r[0] in ids}
    if not tids:
        return []
    with conn.transaction():
        locked = conn.execute(_lock(source, tids, None)).fetchall()
        same = [tid for tid, ident in locked if tids.get(tid) == _id_of(source, ident)]
        alive = {tids[tid] for tid in same}
        written = [failures.rewrite(conn, d) for d in letters if d.message.id in alive]
        failures.forget(conn, source.label, list(alive))
        settle_dead(conn, source, [r for r in rows if r[queries.CLAIM_CTID_COLUMN] in same],
                    alive)  # fmt: skip
    return written


def remove_dead(conn: Any, source: queries.Source, failed: Mapping[str, str]) -> None:
    """Delete dead-lettered rows that cannot be marked (tid → why); one that can be neither
    stops the relay with the grant that fixes it, never a loop of batches that roll back."""
    gone, refused = _delete_dead(conn, source, list(failed))
    left = {tid: why for tid, why in failed.items() if tid not in gone}
    if left:
        raise _neither(source, left, refused)


def _delete_dead(conn: Any, source: queries.Source, tids: list[str]) -> tuple[set[str], str]:
    """DELETE in a savepoint: the tids deleted, and why the others were not."""
    try:
        cursor = conn.execute(_deleted_in_savepoint(source, tids))
        cursor.nextset()
        gone = {str(r[0]) for r in cursor.fetchall()}
    except psycopg.Error as exc:
        conn.execute(_ROLLBACK_TO)
        return set(), _reason(exc)
    return gone, "" if len(gone) == len(tids) else "a trigger kept the row"


def _neither(source: queries.Source, failed: Mapping[str, str], refused: str) -> RelayFailed:
    why = next(iter(failed.values()))
    return RelayFailed(
        f"{len(failed)} dead-lettered row(s) of {source.label} can be neither marked ({why}) "
        f"nor deleted ({refused or 'not tried'}): GRANT DELETE ON "
        f"{source.schema}.{source.claim_table} TO the relay's role (the migration's "
        "grant-dead-letters step does)"
    )


def park(
    parking: Parking,
    label: str,
    batch: Sequence[Message],
    done: Repaired,
    backoff: Callable[[int], float],
    *,
    by_key: bool,
) -> set[MessageId]:
    """Key ordering: failed marks park their keys as rejections do; the ids not to mark."""
    if not (by_key and done.retry and batch):
        return set()
    settled = parking.settle(
        label, sorted(batch, key=lambda m: m.id), {i: done.attempts[i] for i in done.retry},
        now=time.monotonic(), backoff=backoff, last=max(m.id for m in batch),
    )  # fmt: skip
    return settled.held


def _behind_bad_keys(batch: Sequence[Message], bad: set[MessageId]) -> set[MessageId]:
    first: dict[str | None, MessageId] = {}
    held: set[MessageId] = set()
    for message in batch:  # claim order
        if message.key in first:
            held.add(message.id)
        elif message.id in bad:
            first[message.key] = message.id
    return held - bad


def mark_suspects(
    conn: Any,
    source: queries.Source,
    failures: FailedMessages,
    suspects: Suspects,
    rows: Sequence[Any],
    batch: Sequence[Message],
    acked: Sequence[MessageId],
) -> Repaired:
    """Before the batch's mark: mark each acknowledged suspect alone. One that fails again
    counts an attempt; the caller leaves the returned `bad` ids out of the mark."""
    again = suspects.among(source.label, acked)
    tids = {r[queries.CLAIM_CTID_COLUMN]: r[0] for r in rows if r[0] in again}
    done = Repaired()
    if not tids:
        return done
    failed: dict[str, str] = {}
    todo = list(tids)
    key = suspects.key(source.label)
    if key is not None:
        # Those whose id the key holds fail again without a statement each.
        taken = key.taken(conn, [tids[tid] for tid in todo], source.text_ids)
        failed = {tid: key.reason(tids[tid]) for tid in todo if tids[tid] in taken}
        todo = [tid for tid in todo if tid not in failed]
    for tid in todo:
        failed.update(mark_in_halves(conn, source, [tid]))
    marked = [tids[tid] for tid in tids if tid not in failed]
    done.marked = len(marked)
    suspects.update(source.label, [], marked)
    failures.forget(conn, source.label, marked)
    if failed:
        _count(conn, source, failures, suspects, failed, tids, {m.id: m for m in batch}, done)
    return done


def _count(
    conn: Any,
    source: queries.Source,
    failures: FailedMessages,
    suspects: Suspects,
    failed: dict[str, str],
    tids: dict[str, MessageId],
    by_id: dict[MessageId, Message],
    done: Repaired,
) -> None:
    """One attempt for each row that could not be marked; at the last, dead-letter it.
    `by_id` holds the last copy's content, so only that copy is dead-lettered here; another
    copy keeps the counter and is dead-lettered when next claimed (deleted now, it is lost)."""
    done.bad = {tids[tid]: reason for tid, reason in failed.items()}
    last = {ident: tid for tid, ident in tids.items()}  # claim order: the last copy's tid
    held = {i: by_id[i] for i in done.bad if last[i] in failed}
    copies = Counter(tids[tid] for tid in failed)
    others = {i for i in done.bad if copies[i] > (1 if i in held else 0)}
    verdict = failures.record(conn, source.label, list(held.values()), done.bad, keep=others,
                             delivered=True)  # fmt: skip
    dead = {m.id for m in verdict.dead}
    done.attempts, done.letters = verdict.attempts, verdict.letters
    done.retry = verdict.retry + [i for i in others if i not in verdict.retry]
    suspects.update(source.label, done.retry, [i for i in dead if i not in others])
    gone = {last[i]: failed[last[i]] for i in dead}
    if gone:
        remove_dead(conn, source, gone)


def _mark_named_first(
    conn: Any,
    source: queries.Source,
    todo: list[str],
    tids: dict[str, MessageId],
    taken: set[str] | None,
    key: ConflictKey | None,
) -> dict[str, str] | None:
    """Mark every row but the `taken` ones in one statement. None: the caller bisects."""
    if not taken or key is None:
        return None
    rest = [tid for tid in todo if tid not in taken]
    try:
        if rest:
            conn.execute(_marked_in_savepoint(source, rest))
    except psycopg.errors.IntegrityError:
        conn.execute(_ROLLBACK_TO)
        return None
    return {tid: key.reason(tids[tid]) for tid in todo if tid in taken}


def mark_in_halves(conn: Any, source: queries.Source, tids: list[str]) -> dict[str, str]:
    """Mark `tids`, each part in a savepoint; a part that breaks a constraint is split until
    the rows at fault stand alone. Returns tid → reason for those. Parts are marked in claim
    order, so of two rows with one id the first is marked and the second is the bad one."""
    failed: dict[str, str] = {}
    half = len(tids) // 2
    stack = [tids[half:], tids[:half]] if half else [tids] if tids else []
    while stack:
        part = stack.pop()
        # Savepoints by name, not `conn.transaction()`: this also runs through the worker's
        # paused pipeline (`wire.direct`), which only executes statements.
        try:
            conn.execute(_marked_in_savepoint(source, part))
        except psycopg.errors.IntegrityError as exc:
            stop = table_fault(exc, source)
            if stop is not None:
                raise stop from exc
            conn.execute(_ROLLBACK_TO)
            if len(part) == 1:
                failed[part[0]] = _reason(exc)
            else:
                half = len(part) // 2
                stack += [part[half:], part[:half]]
    return failed


_ROLLBACK_TO = sql.SQL("ROLLBACK TO SAVEPOINT om_relay_mark")
_ROLLBACK_TO_OUTER = sql.SQL("ROLLBACK TO SAVEPOINT om_relay_repair")


def _marked_in_savepoint(source: queries.Source, tids: Sequence[str]) -> sql.Composed:
    return sql.SQL(
        "SAVEPOINT om_relay_mark; UPDATE {table} SET {mark} "
        "WHERE {unpublished} AND ctid = ANY({tids}::tid[]){same}; "
        "RELEASE SAVEPOINT om_relay_mark"
    ).format(
        table=source.mark_ident,
        mark=marker.mark(source.marker),
        unpublished=marker.unpublished(source.marker),
        tids=sql.Literal(_tid_array(tids)),
        same=source.same_relation(),
    )


def _deleted_in_savepoint(source: queries.Source, tids: Sequence[str]) -> sql.Composed:
    return sql.SQL(
        "SAVEPOINT om_relay_mark; DELETE FROM {table} WHERE ctid = ANY({tids}::tid[]) "
        "RETURNING ctid::text; RELEASE SAVEPOINT om_relay_mark"
    ).format(table=source.claim_ident, tids=sql.Literal(_tid_array(tids)))


def _reason(exc: psycopg.Error) -> str:
    detail = exc.diag.message_detail
    text = str(exc.diag.message_primary or exc).strip()
    return f"SQLSTATE {exc.sqlstate}: {text}" + (f" ({detail})" if detail else "")


def _tid_array(tids: Sequence[str]) -> str:
    return '{"' + '","'.join(tids) + '"}'


def _id_of(source: queries.Source, ident: Any) -> MessageId:
    return str(ident) if source.text_ids else int(ident)


def _lock(
    source: queries.Source, tids: dict[str, MessageId], key: ConflictKey | None
) -> sql.Composed:
    """Lock the claimed rows still unpublished, with their id; with `key`, which ids its
    table holds already; then constraints immediate and the outer savepoint."""
    ident = sql.Identifier(source.id_column)
    lookup = key.lookup(list(set(tids.values())), source.text_ids) if key else sql.SQL("")
    return sql.SQL(
        "SELECT ctid::text, {id} FROM {table} WHERE {unpublished} "
        "AND ctid = ANY({tids}::tid[]){same} FOR UPDATE SKIP LOCKED; {lookup}; "
        "SET CONSTRAINTS ALL IMMEDIATE; SAVEPOINT om_relay_repair"
    ).format(
        id=sql.SQL("{}::text").format(ident) if source.text_ids else ident,
        table=source.claim_ident,
        unpublished=source.unpublished_filter(),
        tids=sql.Literal(_tid_array(list(tids))),
        same=source.same_relation(),
        lookup=lookup,
    )
