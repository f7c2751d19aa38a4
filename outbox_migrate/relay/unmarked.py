"""Published batches whose mark did not commit: find the rows at fault, mark the rest; and
what a batch settles before its mark (dead-lettered rows, suspects).

A batch is published before its mark; when the mark breaks a constraint (a duplicate id
moving into the published partition after the swap), its transaction rolls back and its rows
are published but unmarked. `repair` marks them again in a transaction of their own, row by
row where needed (relay/mark_repair.py), and counts what it did as the batch's COMMIT would
have: published rows, bad rows, dead letters. The worker's batch loop repairs at once on its
other session (relay/batch_loop.py, `_repair_in_run`); the worker repairs before its next run
otherwise (relay/driver.py).

It runs on a session that is in no transaction and not in pipeline mode, and never waits.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from outbox_migrate.errors import RelayFailed
from outbox_migrate.relay import mark_repair
from outbox_migrate.relay.bad_rows import log_dead
from outbox_migrate.relay.batch import Batch, Commit
from outbox_migrate.relay.message import MessageId
from outbox_migrate.relay.options import Ordering
from outbox_migrate.relay.shared import Shared, one_line

log = logging.getLogger("outbox_migrate.relay")


def repair(
    relay: Shared, index: int, conn: Any, unmarked: list[Commit], error: Exception | None
) -> list[MessageId]:
    """Repair the batches of `unmarked` (emptied as they are done) on `conn`; returns the bad
    rows to claim again. A row that cannot be marked is a bad row: counted, claimed again,
    dead-lettered and removed after `max_attempts`. `error`: what failed when a batch carries
    no mark error of its own (a COMMIT that broke a deferred constraint)."""
    refusals, by_key = relay.refusals, relay.options.ordering is Ordering.key
    encoding = conn.info.encoding
    retry: list[MessageId] = []
    while unmarked:
        commit = unmarked[0]
        claim = commit.batch
        source, batch = claim.source, claim.messages
        failed: psycopg.Error | None = None
        if commit.mark is not None:
            failed = commit.mark.error(encoding)
        if failed is None and isinstance(error, psycopg.Error):
            failed = error
        try:
            if claim.letters:
                # Rolled back with the batch's mark, which failed on another row: written
                # again, in a transaction of their own (never stranded by that row).
                claim.letters = mark_repair.redo_dead(conn, source, refusals.failures,
                                                      claim.rows, claim.letters)  # fmt: skip
                committed(relay, claim)
            done = mark_repair.repair(conn, source, refusals.failures, refusals.suspects,
                                      claim.rows, batch, claim.acked, failed,
                                      by_key=by_key)  # fmt: skip
        except psycopg.errors.IntegrityError as exc:  # the repair broke one: no loop of repairs
            raise RelayFailed(f"repairing a failed mark: {one_line(exc)}") from exc
        unmarked.pop(0)
        log_dead(done.letters)  # committed by the repair's transaction
        mark_repair.park(refusals.parking, source.label, batch, done, relay.backoff,
                         by_key=by_key)  # fmt: skip
        relay.stats.batch(done.marked)
        refusals.count_failures(0, len(done.bad), dead=len(done.letters))
        relay.observer.published(done.marked)
        retry += done.retry
        log.warning(
            "relay.mark_repaired worker=%d marked=%d bad_rows=%d dead_lettered=%d %s",
            index, done.marked, len(done.bad), len(done.letters),
            one_line(failed or error or RelayFailed("a COMMIT failed")),
        )  # fmt: skip
    return retry


def committed(relay: Shared, claim: Batch) -> None:
    """The batch's dead letters committed: count and log them (not before: bad_rows.py)."""
    if not claim.letters:
        return
    relay.stats.add(dead_lettered=len(claim.letters))
    log_dead(claim.letters)


def before_mark(
    relay: Shared, conn: Any, claim: Batch, acked: list[MessageId]
) -> tuple[list[MessageId], list[MessageId]]:
    """In the batch's transaction, before its mark: the rows dead-lettered by the publish
    leave the outbox, each on its own (`mark_repair.settle_dead`: the batch's mark, failing
    on one of them, rolled all their dead letters back); then suspects are marked alone.
    Returns the acknowledged ids left for the batch's mark and the ids to claim again."""
    if claim.letters:
        dead = {d.message.id for d in claim.letters}
        mark_repair.settle_dead(conn, claim.source, claim.rows, dead)
    if not (relay.refusals.suspects and acked):
        return acked, []
    return mark_suspects(relay, conn, claim, acked)


def mark_suspects(
    relay: Shared, conn: Any, claim: Batch, acked: list[MessageId]
) -> tuple[list[MessageId], list[MessageId]]:
    """In the batch's transaction, before its mark: rows whose mark failed before are marked
    alone first (relay/mark_repair.py). Returns the acknowledged ids left for the batch's
    mark and the ids to claim again; their dead letters join the batch's (`claim.letters`)."""
    refusals, by_key = relay.refusals, relay.options.ordering is Ordering.key
    done = mark_repair.mark_suspects(conn, claim.source, refusals.failures, refusals.suspects,
                                     claim.rows, claim.messages, acked)  # fmt: skip
    if not (done.bad or done.marked):
        return acked, []  # no suspect in this batch: the common case, kept cheap
    claim.letters += done.letters
    refusals.count_failures(0, len(done.bad))
    held = mark_repair.park(refusals.parking, claim.source.label, claim.messages, done,
                            relay.backoff, by_key=by_key)  # fmt: skip
    return [i for i in acked if i not in done.bad and i not in held], done.retry
