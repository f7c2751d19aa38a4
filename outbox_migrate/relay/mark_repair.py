"""Find the rows whose mark breaks a constraint, mark the rest: one bad row, not a crash loop.

A batch's mark is one UPDATE of all its rows. When one row cannot be marked — after the swap,
a row whose application id is already in the published partition, which carries the old
table's primary key; a CHECK or trigger that refuses the move — the UPDATE fails for all of
them, the batch rolls back after it was published, and every run would re-send and fail the
same batch. Here the rows are marked again in halves (bisection), each half in a savepoint:
a half that fails is split until the failing rows stand alone. Those are bad rows
(relay/bad_rows.py): counted in the database, claimed again, and at `max_attempts` kept in the
dead-letter table with the constraint's message and removed from the outbox — they cannot be
marked, and nothing is lost. Cost: about 2·log2(batch) statements per bad row, paid only by
the batch that holds it.

Runs in its own transaction on the worker's session (no pipeline), never waits on a lock
(`SKIP LOCKED`: a row another relay holds is its business now).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.relay import queries
from outbox_migrate.relay.bad_rows import FailedMessages
from outbox_migrate.relay.message import Message, MessageId


@dataclass
class Repaired:
    marked: int = 0
    bad: dict[MessageId, str] = field(default_factory=dict)
    dead: list[Message] = field(default_factory=list)
    retry: list[MessageId] = field(default_factory=list)


def repair(
    conn: Any,
    source: queries.Source,
    failures: FailedMessages,
    rows: Sequence[Any],
    batch: Sequence[Message],
    acked: Sequence[MessageId],
) -> Repaired:
    """Mark the acknowledged rows of a batch whose mark failed; count the rows at fault."""
    wanted = set(acked)
    by_id = {m.id: m for m in batch}
    tids = {r[queries.CLAIM_CTID_COLUMN]: r[0] for r in rows if r[0] in wanted}
    done = Repaired()
    if not tids:
        return done
    with conn.transaction():
        # A deferred constraint would fail at COMMIT, for all rows again: check at each mark.
        conn.execute("SET CONSTRAINTS ALL IMMEDIATE")
        locked = conn.execute(_lock(source), {"tids": _tid_array(list(tids))}).fetchall()
        # Same ctid and id, still unpublished: the row the batch claimed (in claim order).
        same = {tid for tid, ident in locked if tids.get(tid) == _id_of(source, ident)}
        todo = [tid for tid in tids if tid in same]
        failed = _mark_in_halves(conn, queries.mark(source), todo)
        done.marked = len(todo) - len(failed)
        if not failed:
            return done
        done.bad = {tids[tid]: reason for tid, reason in failed.items()}
        verdict = failures.record(conn, source.label, [by_id[i] for i in done.bad], done.bad)
        done.dead, done.retry = verdict.dead, verdict.retry
        dead = {m.id for m in verdict.dead}
        gone = [tid for tid in failed if tids[tid] in dead]
        if gone:
            # Dead-lettered rows cannot be marked: they leave the outbox (the dead-letter
            # table holds them) so they are not claimed again.
            conn.execute(_delete(source), {"tids": _tid_array(gone)})
        marked = [tids[tid] for tid in todo if tid not in failed]
        failures.forget(conn, source.label, failures.seen_before(source.label, marked))
    return done


def _mark_in_halves(conn: Any, mark: sql.Composed, tids: list[str]) -> dict[str, str]:
    """Mark `tids`, each part in a savepoint; a part that breaks a constraint is split until
    the rows at fault stand alone. Returns tid → reason for those. Parts are marked in claim
    order, so of two rows with one id the first is marked and the second is the bad one."""
    failed: dict[str, str] = {}
    stack = [tids] if tids else []
    while stack:
        part = stack.pop()
        try:
            with conn.transaction():
                conn.execute(mark, {"tids": _tid_array(part)})
        except psycopg.errors.IntegrityError as exc:
            if len(part) == 1:
                failed[part[0]] = _reason(exc)
            else:
                half = len(part) // 2
                stack += [part[half:], part[:half]]
    return failed


def _reason(exc: psycopg.Error) -> str:
    detail = exc.diag.message_detail
    text = str(exc.diag.message_primary or exc).strip()
    return f"SQLSTATE {exc.sqlstate}: {text}" + (f" ({detail})" if detail else "")


def _tid_array(tids: Sequence[str]) -> str:
    return '{"' + '","'.join(tids) + '"}'


def _id_of(source: queries.Source, ident: Any) -> MessageId:
    return str(ident) if source.text_ids else int(ident)


def _lock(source: queries.Source) -> sql.Composed:
    ident = sql.Identifier(source.id_column)
    return sql.SQL(
        "SELECT ctid::text, {id} FROM {table} WHERE {unpublished} "
        "AND ctid = ANY(%(tids)s::tid[]) FOR UPDATE SKIP LOCKED"
    ).format(
        id=sql.SQL("{}::text").format(ident) if source.text_ids else ident,
        table=source.claim_ident,
        unpublished=source.unpublished_filter(),
    )


def _delete(source: queries.Source) -> sql.Composed:
    return sql.SQL("DELETE FROM {} WHERE ctid = ANY(%(tids)s::tid[])").format(source.claim_ident)
