"""A worker's second session: it claims the next batch while the current one is published.

Why. A batch is claim → publish → mark → commit, and on one session those steps are strictly
serial: while the relay builds and publishes batch k the server waits, and while the server
marks k and claims k+1 the relay waits. Draining a backlog, each side is idle about half of
the time (measured: the relay's own CPU was 0.9 s of a 1.8 s drain of 300,000 rows at batch
1000). With a second session the claim of k+1 runs on the server while the relay publishes k,
and k's mark and COMMIT run while the relay publishes k+1: the two halves overlap instead of
adding up (bench/relay.py, section 1). With a broker that takes milliseconds to acknowledge,
the next claim hides behind that wait too.

Batches alternate between the worker's lease session (the one holding its shard locks) and
this one, each batch in a transaction of the session that claimed it; the worker keeps
everything else on the lease session (relay/batch_loop.py, `_publish_run`).

Why it is safe:

* Only a plain *range* claim runs ahead: `id > the last id of the batch in hand`, in the same
  shards. The batch in hand holds ids up to that bound, so the two sessions never try to lock
  each other's rows; a row moved by one session's mark is never visited by the other's
  claim (the "tuple to be locked was already moved" error needs the same row).
* Whatever needs the cursor's bookkeeping or the lease — gap probes, rescans from id 0,
  horizons, notified ids, the idle flag, the rebalance — is not read ahead: the worker stops
  reading ahead whenever one of them is due, lets this session's last batch commit, and
  claims on the lease session as before.
* Read-ahead is used only with `--ordering none` and integer ids, and only while claims come
  back full (a backlog): publishing stays one batch at a time, in id order, so it changes
  when rows are claimed, not what is delivered or in which order.
* The fence is proven only by claims on the lease session (relay/fencing.py): a batch claimed
  here is published only while the lease session's last proof allows it.
* A batch whose publish is rejected, or a stop, rebalance or switch, rolls the read-ahead
  back unpublished: its rows are claimed again later. Any error on this session is raised like
  one of the lease session's; the worker then closes both sessions (the server rolls back
  whatever they held) and starts over.

This session holds no shard lock, so the server's idle-session timeout — which exists to free
a silent relay's shards — is off here; the idle-in-transaction timeout and keepalives stay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from psycopg import pq

from outbox_migrate.relay import keepalive, queries, wire

log = logging.getLogger("outbox_migrate.relay")


@dataclass
class Pending:
    """A claim sent ahead and not read yet."""

    pipe: wire.Wire
    conn: Any
    slot: wire.Slot
    after: int
    sent: float
    """monotonic time the claim was sent (a proof of the lease if `pipe` is the lease's)."""


class ReadAhead:
    """The second session of one worker: opened at its first use, closed on any error."""

    def __init__(self, open_session: Callable[[], Any]) -> None:
        self._open_session = open_session
        self.conn: Any = None
        self.pipe: wire.Wire | None = None

    def session(self, statements: Iterable[bytes]) -> tuple[Any, wire.Wire]:
        """The session, connected and with `statements` prepared."""
        if self.conn is None or self.conn.closed or self.pipe is None:
            self.close()
            conn = self._open_session()
            self.conn, self.pipe = conn, wire.Wire(conn)
        pipe = self.pipe
        for statement in statements:
            pipe.prepare(statement)
        return self.conn, pipe

    def send(
        self, pipe: wire.Wire, conn: Any, claim: bytes, params: dict[str, Any], after: int
    ) -> Pending:
        """Queue BEGIN and the range claim from `after` on `pipe`, and send them now."""
        sent = time.monotonic()
        pipe.send_plain(b"BEGIN")
        slot = pipe.send(claim, {**params, "after": after})
        pipe.send_sync()
        return Pending(pipe, conn, slot, after, sent)

    @staticmethod
    def receive(pending: Pending) -> list[tuple[Any, ...]]:
        """Read the claim's rows (and whatever that session had in flight before it)."""
        pending.pipe.sync()
        return pending.pipe.rows(pending.slot)

    def settle(self) -> None:
        """After a run of batches: read what this session still has in flight (its last
        COMMIT, a dropped read-ahead's ROLLBACK) and leave pipeline mode; raises its error."""
        pipe = self.pipe
        if pipe is None:
            return
        try:
            pipe.pause()  # reads everything in flight, then leaves pipeline mode
        except BaseException:
            self.close()
            raise

    def abandon(self) -> None:
        """After a failure on the lease session: read what is in flight here (so a COMMIT
        that went through is known and counted), roll back a transaction still open (a batch
        claimed ahead), leave pipeline mode. Any error here closes the session instead."""
        pipe, conn = self.pipe, self.conn
        if pipe is None or conn is None:
            return
        if pipe.pg.status != pq.ConnStatus.OK:
            self.close()
            return
        try:
            pipe.pause()  # reads everything in flight, then leaves pipeline mode
            if conn.info.transaction_status != pq.TransactionStatus.IDLE:
                conn.execute(b"ROLLBACK")
        except Exception:  # this session failed too: the server rolls it back when closed
            log.debug("relay.read_ahead_abandon_failed", exc_info=True)
            self.close()

    def close(self) -> None:
        """Drop the session: the server rolls back whatever it held."""
        conn, self.conn, self.pipe = self.conn, None, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # a broken connection may fail to close too
                log.debug("relay.read_ahead_close_failed", exc_info=True)


def open_session(
    connect: Callable[[], Any], timeout_s: float, poll_interval_s: float
) -> Callable[[], Any]:
    """How the worker opens its read-ahead session: like its lease session (keepalives,
    timeouts, the id-order plan settings), without the idle-session timeout."""

    def opened() -> Any:
        conn = connect()
        try:
            keepalive.configure_session(conn, timeout_s, poll_interval_s, idle_session=False)
            conn.execute(queries.claim_session_settings())
            conn.prepare_threshold = None  # see the worker: psycopg's DEALLOCATE ALL
        except BaseException:
            conn.close()
            raise
        return conn

    return opened
