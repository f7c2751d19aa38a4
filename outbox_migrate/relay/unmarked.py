"""The polling worker's side of mark repair: published batches whose mark did not commit, and
what a batch settles before its mark. On a session out of pipeline mode; never waits.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from outbox_migrate.db import one_line
from outbox_migrate.errors import RelayFailed
from outbox_migrate.relay import mark_repair
from outbox_migrate.relay.bad_rows import log_dead
from outbox_migrate.relay.batch import Batch, Commit
from outbox_migrate.relay.message import MessageId
from outbox_migrate.relay.options import Ordering
from outbox_migrate.relay.run_stats import count_failures
from outbox_migrate.relay.shared import Shared

log = logging.getLogger("outbox_migrate.relay")


def repair(
    relay: Shared, index: int, conn: Any, unmarked: list[Commit], error: Exception | None
) -> list[MessageId]:
    """Mark the batches of `unmarked` again (emptied as done), counting what the COMMIT would
    have; the bad rows to claim again. `error`: a deferred constraint's failure."""
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
        stop = mark_repair.table_fault(failed, source)
        if stop is not None:  # the rows stay unpublished: sent again once the table is fixed
            raise stop
        try:
            if claim.letters:
                # Rolled back with the mark that failed on another row: written again.
                claim.letters = mark_repair.redo_dead(conn, source, refusals.failures,
                                                      claim.rows, claim.letters)  # fmt: skip
                committed(relay, claim)
            done = mark_repair.repair(conn, source, refusals.failures, refusals.suspects,
                                      claim.rows, batch, claim.acked, failed,
                                      by_key=by_key)  # fmt: skip
        except psycopg.errors.IntegrityError as exc:  # the repair broke one: no loop of repairs
            raise RelayFailed(f"repairing a failed mark: {one_line(str(exc))}") from exc
        unmarked.pop(0)
        log_dead(done.letters)  # committed by the repair's transaction
        mark_repair.park(refusals.parking, source.label, batch, done, relay.options.backoff,
                         by_key=by_key)  # fmt: skip
        relay.stats.batch(done.marked)
        count_failures(relay.stats, relay.observer, bad=len(done.bad), dead=len(done.letters))
        relay.observer.published(done.marked)
        retry += done.retry
        log.warning(
            "relay.mark_repaired worker=%d marked=%d bad_rows=%d dead_lettered=%d %s",
            index, done.marked, len(done.bad), len(done.letters),
            one_line(str(failed or error or RelayFailed("a COMMIT failed"))),
        )  # fmt: skip
    return retry


def committed(relay: Shared, claim: Batch) -> None:
    """The batch's dead letters committed: count and log them (not before)."""
    if not claim.letters:
        return
    relay.stats.add(dead_lettered=len(claim.letters))
    log_dead(claim.letters)


def before_mark(
    relay: Shared, conn: Any, claim: Batch, acked: list[MessageId]
) -> tuple[list[MessageId], list[MessageId]]:
    """Before the batch's mark: dead-lettered rows leave the outbox on their own (one failing
    in the mark would roll all their dead letters back), then suspects are marked alone.
    Returns the ids left for the mark and the ids to claim again."""
    if claim.letters:
        dead = {d.message.id for d in claim.letters}
        mark_repair.settle_dead(conn, claim.source, claim.rows, dead)
    if not (relay.refusals.suspects and acked):
        return acked, []
    refusals, by_key = relay.refusals, relay.options.ordering is Ordering.key
    done = mark_repair.mark_suspects(conn, claim.source, refusals.failures, refusals.suspects,
                                     claim.rows, claim.messages, acked)  # fmt: skip
    if not (done.bad or done.marked):
        return acked, []  # no suspect in this batch: the common case, kept cheap
    claim.letters += done.letters
    count_failures(relay.stats, relay.observer, bad=len(done.bad))
    held = mark_repair.park(refusals.parking, claim.source.label, claim.messages, done,
                            relay.options.backoff, by_key=by_key)  # fmt: skip
    return [i for i in acked if i not in done.bad and i not in held], done.retry
