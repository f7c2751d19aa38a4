"""One replication connection's stream loop: transactions in, batches out, positions back.

The state machine behind `CdcRelay` (see its module doc for the guarantees):

* frames are read until none is waiting; each transaction's outbox inserts are kept between
  its Begin and Commit; complete transactions collect in `pending`;
* `pending` is published when no frame is waiting or it reached the batch size (always at a
  transaction boundary); the acknowledged ids then wait in `acked` for the mark;
* marks run *behind* the stream: once per `mark_interval_s` (or as soon as `MARK_MAX_IDS` ids
  wait) the ids acknowledged since the last mark go out as one statement on the marks session,
  sent without waiting for it; the loop keeps reading and publishing, and collects the mark's
  result when its socket becomes readable (or after the next publish). Only then is the end
  of the last transaction the mark covers confirmed: confirmation trails the marks, never the
  other way round, and one mark at a time is in flight;
* with nothing received-and-unconfirmed, the position a keepalive reports is confirmed, so the
  slot follows the server while only other tables are written;
* a stop, a broker outage or catching up first flushes: the mark in flight is collected, the
  rest of `acked` is marked, and their end is confirmed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outbox_migrate.errors import OutboxMigrateError
from outbox_migrate.relay.cdc import pgoutput
from outbox_migrate.relay.cdc.options import IDLE_TICK_S, MARK_MAX_IDS, STATUS_INTERVAL_S
from outbox_migrate.relay.errors import SinkUnavailable
from outbox_migrate.relay.message import Message, MessageId

if TYPE_CHECKING:
    from outbox_migrate.relay.cdc.relay import CdcRelay, _Columns
    from outbox_migrate.relay.cdc.stream import ReplicationStream


@dataclass
class _Pending:
    """Complete transactions received and not yet published."""

    messages: list[Message] = field(default_factory=list)
    transactions: int = 0
    end_lsn: int = 0
    started: float = 0.0


class StreamSession:
    """Reads one stream until the relay stops (or, `until_caught_up`, catches up)."""

    def __init__(self, relay: CdcRelay, stream: ReplicationStream) -> None:
        self.relay = relay
        self.stream = stream
        self.relations: dict[int, _Columns | None] = {}
        self.partition = (relay.spec.schema, relay.spec.unpublished_partition)
        self.pending = _Pending()
        self.txn: list[Message] | None = None
        self.txn_commit = 0
        self.acked: list[MessageId] = []
        """Acknowledged ids not yet sent in a mark."""
        self.acked_end = 0
        """End of the last acknowledged transaction."""
        self.marking_end: int | None = None
        """End of the last transaction the mark in flight covers (None: no mark in flight)."""
        self.confirmed = 0
        self.last_status = time.monotonic()
        self.last_mark = time.monotonic()

    @property
    def in_flight(self) -> bool:
        """Anything received that the slot must not be confirmed past yet."""
        return (
            self.txn is not None
            or self.pending.end_lsn > self.confirmed
            or self.acked_end > self.confirmed
        )

    def run(self) -> None:
        relay, stream = self.relay, self.stream
        stopping = relay.stop_event.is_set
        poll, handle, keepalive = stream.poll_message, self._message, pgoutput.Keepalive
        until_caught_up = relay.options.until_caught_up
        try:
            while not stopping():
                # What is already buffered first: the timeout and the marks' socket only
                # matter when the loop is about to wait.
                item = poll() or stream.next_message(self._timeout(), relay.mark_socket())
                if item is None:
                    self._idle()
                elif type(item) is keepalive:
                    self._keepalive(item)
                else:
                    handle(item)
                    continue
                if until_caught_up and self._caught_up():
                    self.flush()
                    return
            self.flush()  # stopped: what the broker acknowledged is marked and confirmed
        except SinkUnavailable:
            # The stream is dropped and re-read from the confirmed position: first settle
            # what the broker did acknowledge, so it is not sent again.
            self.flush()
            raise
        except OutboxMigrateError as exc:
            from outbox_migrate.relay.cdc.relay import _Interrupted

            if isinstance(exc, _Interrupted):  # stopped inside a batch's retries
                self.flush()
            raise

    def _timeout(self) -> float:
        if self.pending.end_lsn > max(self.confirmed, self.acked_end):
            return 0.0
        if self.acked_end > self.confirmed and self.marking_end is None:
            wait = self.relay.options.mark_interval_s - (time.monotonic() - self.last_mark)
            return max(0.0, min(wait, IDLE_TICK_S))
        return IDLE_TICK_S

    def _caught_up(self) -> bool:
        return (
            self.txn is None
            and not self.pending.messages
            and max(self.confirmed, self.acked_end) >= self.relay.target_lsn
        )

    def _idle(self) -> None:
        """Nothing waiting: publish what is pending, move the marks on, ping the server."""
        self.relay.observer.heartbeat(0)  # the loop is alive (liveness, /healthz)
        if self.pending.end_lsn > max(self.confirmed, self.acked_end):
            self.publish()
        self.marks()
        if time.monotonic() - self.last_status >= STATUS_INTERVAL_S:
            self._status(self.confirmed, reply=True)

    def _keepalive(self, frame: pgoutput.Keepalive) -> None:
        if not self.in_flight and frame.wal_end > self.confirmed:
            # Nothing of ours is in flight: everything that commits before this position has
            # been sent, so the slot may move up to it.
            self.confirmed = frame.wal_end
            self._status(self.confirmed)
            self.relay.stats.add(idle_confirms=1)
            self.relay.stats.confirmed_lsn = self.confirmed
        elif frame.reply_requested:
            self._status(self.confirmed)

    def _message(self, message: pgoutput.Decoded | pgoutput.Keepalive) -> None:
        if isinstance(message, pgoutput.Insert):
            columns = self.relations.get(message.oid)
            if columns is not None and self.txn is not None:
                self.txn.append(self.relay.message(columns, message.values))
        elif isinstance(message, pgoutput.Begin):
            self.txn, self.txn_commit = [], message.commit_micros
            if not self.pending.messages:
                self.pending.started = time.monotonic()
        elif isinstance(message, pgoutput.Commit):
            if self.txn:
                self.pending.messages.extend(self.txn)
                self.pending.transactions += 1
                if self.relay.oldest_unconfirmed is None:
                    self.relay.oldest_unconfirmed = self.txn_commit
            self.pending.end_lsn = max(self.pending.end_lsn, message.end_lsn)
            self.txn = None
            if len(self.pending.messages) >= self.relay.options.batch_size:
                self.publish()
                self.marks()
        elif isinstance(message, pgoutput.Relation):
            ours = (message.namespace, message.name) == self.partition
            self.relations[message.oid] = self.relay.columns_for(message) if ours else None

    def publish(self) -> None:
        """Publish the pending transactions and wait for the broker's acknowledgement."""
        pending, relay = self.pending, self.relay
        if pending.messages:
            relay.deliver(pending.messages)
            self.acked.extend(m.id for m in pending.messages)
            relay.stats.add(
                published=len(pending.messages), batches=1, transactions=pending.transactions
            )
            relay.observer.published(len(pending.messages))
            relay.observer.batch_seconds(time.monotonic() - pending.started)
        self.acked_end = max(self.acked_end, pending.end_lsn)
        self.pending = _Pending()

    def marks(self) -> None:
        """Collect the mark in flight (confirming what it covers), then send the next one
        when due. Never waits, except when `MARK_MAX_IDS` ids pile up behind a mark in
        flight (the server is slower than the stream: the stream waits rather than let the
        re-sent-after-a-crash window grow without bound)."""
        relay = self.relay
        if self.marking_end is not None:
            if not relay.mark_done():
                if len(self.acked) < MARK_MAX_IDS:
                    return
                relay.wait_mark()
            self._confirm(self.marking_end)
            self.marking_end = None
        if self.acked_end <= self.confirmed:
            return
        now = time.monotonic()
        if (
            relay.options.mark
            and now - self.last_mark < relay.options.mark_interval_s
            and len(self.acked) < MARK_MAX_IDS
        ):
            return
        self.last_mark = now
        if relay.send_mark(self.acked):
            self.marking_end = self.acked_end
            self.acked = []
        else:  # nothing to mark (--no-mark, or transactions without outbox rows)
            self.acked = []
            self._confirm(self.acked_end)

    def flush(self) -> None:
        """Mark everything acknowledged and confirm it, waiting for the server."""
        if self.marking_end is not None:
            self.relay.wait_mark()
            self._confirm(self.marking_end)
            self.marking_end = None
        if self.acked_end > self.confirmed:
            if self.relay.send_mark(self.acked):
                self.relay.wait_mark()
            self.acked = []
            self._confirm(self.acked_end)

    def _confirm(self, lsn: int) -> None:
        if lsn <= self.confirmed:
            return
        self.confirmed = lsn
        self._status(lsn)
        self.relay.stats.confirmed_lsn = lsn
        self.relay.oldest_unconfirmed = None
        self.relay.observer.heartbeat(0)

    def _status(self, lsn: int, *, reply: bool = False) -> None:
        self.stream.confirm(lsn, reply=reply)
        self.last_status = time.monotonic()
