"""One replication connection's stream loop: transactions in, batches out, positions back.

The state machine behind `CdcRelay` (see its module doc for the guarantees). It is handed
its collaborators — the message builder, the delivery, the marks session, counters, the stop
event — and imports nothing of the relay that owns it:

* per wake-up, every frame libpq has received is taken in one call (`stream.drain`) and acted
  on in one call (`_frames`, decoding in place); each transaction's outbox inserts are kept
  between its Begin and Commit; complete transactions collect in `pending`;
* `pending` is published once nothing more is buffered and the linger is over, or at once
  when it reached the batch size (always at a transaction boundary); the acknowledged ids
  then wait in `acked` for the mark. The loop's cost is per wake-up, not per frame
  (docs/relay.md, "CDC mode: CPU");
* the linger (`linger_s`): a wake-up that leaves a transaction to publish (or one begun)
  does not publish it at once. It sleeps — a plain timed sleep, not watching the socket —
  until `linger_s` after that transaction's first frame arrived, then reads everything the
  socket holds, decodes it in one pass and publishes the complete transactions as one
  batch: one wake-up for several transactions, and the keepalives that arrived meanwhile.
  Socket data already waiting (a backlog) is read before sleeping, and a full batch is
  published as it completes, so a backlog never waits. After a lingered publish the next
  wait is a sleep of `linger_s` too (a steady stream: one wake-up per linger, not two),
  and a sleep that brings nothing returns to waiting on the socket. An idle stream still
  wakes on its first packet; a lone insert is delivered `linger_s` plus processing after
  it arrived, and nothing waits more than that;
* marks run *behind* the stream: once per `mark_interval_s` (or as soon as `MARK_MAX_IDS` ids
  wait) the ids acknowledged since the last mark go out as one statement on the marks session,
  sent without waiting for it; the loop keeps reading and publishing, and collects the mark's
  result when its socket becomes readable (or after the next publish). Only then is the end
  of the last transaction the mark covers confirmed: confirmation trails the marks, never the
  other way round, and one mark at a time is in flight. A transaction the mark's snapshot did
  not show yet (the stream can carry a commit a moment before other sessions see it:
  relay/cdc/marks.py) is marked again with the next mark, and nothing is confirmed until a
  mark saw every transaction it covers;
* with nothing received-and-unconfirmed, the position a keepalive reports is confirmed, so the
  slot follows the server while only other tables are written;
* a stop, a broker outage or catching up first flushes: the mark in flight is collected, the
  rest of `acked` is marked, and their end is confirmed.
"""

from __future__ import annotations

import struct
import threading
import time

from outbox_migrate.errors import SinkUnavailable
from outbox_migrate.relay.cdc import pgoutput
from outbox_migrate.relay.cdc.delivery import Delivery, Interrupted
from outbox_migrate.relay.cdc.marks import MarkSession
from outbox_migrate.relay.cdc.messages import Columns, MessageBuilder
from outbox_migrate.relay.cdc.stream import ReplicationStream
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.metrics import Observer
from outbox_migrate.relay.options import (
    IDLE_CONFIRM_S,
    IDLE_TICK_S,
    MARK_MAX_IDS,
    STATUS_INTERVAL_S,
    CdcOptions,
)
from outbox_migrate.relay.run_stats import CdcStats, Unconfirmed

_I64 = struct.Struct("!q")
_U64 = struct.Struct("!Q")
_U32 = struct.Struct("!I")
FLUSH_MARK_TRIES = 20
"""A stop's last mark, tried again (FLUSH_RETRY_S apart) while its snapshot does not show some
of its transactions yet; then the slot is left unconfirmed past them (re-streamed)."""
FLUSH_RETRY_S = 0.05
_KEEPALIVE = struct.Struct("!Qq?")


class StreamSession:
    """Reads one stream until the relay stops (or, `until_caught_up`, catches up)."""

    def __init__(
        self,
        stream: ReplicationStream,
        options: CdcOptions,
        *,
        builder: MessageBuilder,
        delivery: Delivery,
        marks: MarkSession,
        stats: CdcStats,
        observer: Observer,
        stop: threading.Event,
        target_lsn: int,
        unconfirmed: Unconfirmed,
        careful_until: int = 0,
    ) -> None:
        self.stream = stream
        self.options = options
        self.builder = builder
        self.delivery = delivery
        self.mark_session = marks
        self.stats = stats
        self.observer = observer
        self.stop = stop
        self.target_lsn = target_lsn
        self.unconfirmed = unconfirmed
        self.careful_until = careful_until
        """After a run that died without a trace: batches that may hold what it was
        publishing (before this position) count their attempts first (`crash_guard`)."""
        self.relations: dict[int, Columns | None] = {}
        spec = builder.spec
        self.partition = (spec.schema, spec.unpublished_partition)
        self.txn: list[Message] | None = None
        self.txn_commit = 0
        self.txn_xid = 0
        self.pending: list[Message] = []
        """Messages of complete transactions received and not yet published."""
        self.pending_transactions = 0
        self.pending_txns: dict[int, list[MessageId]] = {}
        """The ids of `pending` by transaction (xid): what a mark must see."""
        self.pending_end = 0
        """End of the last complete transaction received (with or without outbox rows)."""
        self.txn_began = 0.0
        """When the open transaction's Begin arrived (its wake-up's time)."""
        self.linger_from: float | None = None
        """When the first frame of what waits to be published arrived (None: nothing waits);
        the linger ends `linger_s` later."""
        self.acked: list[MessageId] = []
        """Acknowledged ids not yet sent in a mark."""
        self.acked_txns: dict[int, list[MessageId]] = {}
        """`acked` by transaction; `marking_txns`: those of the mark in flight."""
        self.marking_txns: dict[int, list[MessageId]] = {}
        self.acked_end = 0
        """End of the last acknowledged transaction."""
        self.marking_end: int | None = None
        """End of the last transaction the mark in flight covers (None: no mark in flight)."""
        self.confirmed = 0
        self.received = 0
        """The furthest position the server said it sent (keepalives, commits): reported as
        written, never as flushed."""
        self.last_status = time.monotonic()
        self.last_mark = time.monotonic()
        self.last_idle_confirm = 0.0

    @property
    def in_flight(self) -> bool:
        """Anything received that the slot must not be confirmed past yet."""
        return (
            self.txn is not None
            or self.pending_end > self.confirmed
            or self.acked_end > self.confirmed
        )

    def run(self) -> None:
        stream = self.stream
        stopping = self.stop.is_set
        drain, wait, frames = stream.drain, stream.wait, self._frames
        linger = self.options.linger_s
        until_caught_up = self.options.until_caught_up
        try:
            while not stopping():
                # Per wake-up: every frame libpq holds in one call, acted on in one call.
                received: list[bytes] | None = drain()
                if not received and linger and self.linger_from is not None:
                    received = self._linger(self.linger_from + linger)
                    if received is None:
                        continue  # slept: what arrived meanwhile is taken now
                if received:
                    frames(received)
                    continue
                # Nothing buffered, the linger over: publish the complete transactions (no
                # extra poll for more: what arrives meanwhile is read right after), move
                # the marks on, then sleep until the socket has more.
                busy = False
                if self.pending_end > self.acked_end and self.pending_end > self.confirmed:
                    self.publish()
                    busy = linger > 0
                elif self.txn is None:
                    self.linger_from = None
                self.marks()
                if until_caught_up and self._caught_up():
                    self.flush(settle=True)
                    return
                if busy:
                    self._sleep_while_busy(linger)
                    continue
                if not wait(self._timeout(), self.mark_session.socket()):
                    self._idle()
            self.flush()  # stopped: what the broker acknowledged is marked and confirmed
        except SinkUnavailable:
            # The stream is dropped and re-read from the confirmed position: first settle
            # what the broker did acknowledge, so it is not sent again.
            self.flush()
            raise
        except Interrupted:  # stopped inside a batch's retries
            self.flush()
            raise

    def _linger(self, until: float) -> list[bytes] | None:
        """Something waits to be published: the frames the socket already holds (a backlog,
        or the rest of what arrived during the linger: libpq reads one buffer at a time),
        taken without waiting; else, until `until`, a sleep that does not watch the socket
        (each wake-up costs more than the frames it brings): None. An empty list: the
        linger is over, publish."""
        self.stream.receive()
        received = self.stream.drain()
        if not received:
            remaining = until - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)
                return None
        return received

    def _sleep_while_busy(self, linger: float) -> None:
        """A lingered batch went out: while the stream stays busy, sleep one linger rather
        than wake for the next packet (a wake-up for it and another after its linger would
        cost two). What arrives meanwhile counts as arrived at the start of the sleep, so it
        is published at its end; a sleep that brings nothing returns the loop to waiting on
        the socket (an idle stream wakes on its first packet)."""
        if self.linger_from is None:
            self.linger_from = time.monotonic()
        time.sleep(linger)
        self.stream.receive()

    def _timeout(self) -> float:
        if self.acked_end > self.confirmed and self.marking_end is None:
            wait = self.options.mark_interval_s - (time.monotonic() - self.last_mark)
            return max(0.0, min(wait, IDLE_TICK_S))
        return IDLE_TICK_S

    def _caught_up(self) -> bool:
        return (
            self.txn is None
            and not self.pending
            and max(self.confirmed, self.acked_end) >= self.target_lsn
        )

    def _idle(self) -> None:
        """Nothing arrived for a while: ping the server now and then."""
        self.observer.heartbeat(0)  # the loop is alive (liveness, /healthz)
        if time.monotonic() - self.last_status >= STATUS_INTERVAL_S:
            self._status(self.confirmed, reply=True)

    def _frames(self, frames: list[bytes]) -> None:
        """Act on the frames of one wake-up: keep each transaction's outbox inserts between
        its Begin and Commit, publish once `batch_size` messages are complete, and answer
        keepalives. Decoded in place (pgoutput's layouts), the common messages first: this
        runs for every message the stream carries."""
        relations = self.relations
        build = self.builder.message
        keepalive = reply = False
        now = time.monotonic()  # when this wake-up's frames arrived, for the linger
        try:
            for data in frames:
                tag = data[0]
                if tag == 0x77:  # 'w' XLogData: a pgoutput message after a 25-byte header
                    kind = data[25]
                    if kind == 0x49:  # 'I'
                        insert = pgoutput.insert_at(data, 25)
                        columns = relations.get(insert.oid)
                        if columns is not None and self.txn is not None:
                            self.txn.append(build(columns, insert.values))
                    elif kind == 0x42:  # 'B': final LSN, then the commit time
                        self.txn = []
                        self.txn_commit = _I64.unpack_from(data, 34)[0]
                        self.txn_xid = _U32.unpack_from(data, 42)[0]
                        self.txn_began = now
                        if self.linger_from is None:
                            self.linger_from = now
                    elif kind == 0x43:  # 'C': flags, commit LSN, then the end LSN
                        self._commit(_U64.unpack_from(data, 35)[0])
                    elif kind == 0x52:  # 'R'
                        self._relation(pgoutput.decode_at(data, 25))
                    # Origin, Type, Update, Delete, Truncate, logical messages: not ours
                elif tag == 0x6B:  # 'k'
                    wal_end, _sent, requested = _KEEPALIVE.unpack_from(data, 1)
                    self.received = max(self.received, wal_end)
                    keepalive = True
                    reply = reply or requested
                else:
                    raise pgoutput.DecodeError(f"unexpected replication frame {chr(tag)!r}")
        except (struct.error, IndexError) as exc:
            raise pgoutput.DecodeError(f"malformed replication frame: {exc}") from None
        if keepalive:
            self._keepalive(reply)

    def _relation(self, relation: pgoutput.Decoded) -> None:
        if type(relation) is pgoutput.Relation:
            ours = (relation.namespace, relation.name) == self.partition
            self.relations[relation.oid] = self.builder.columns_for(relation) if ours else None

    def _commit(self, end_lsn: int) -> None:
        txn = self.txn
        if txn:
            self.pending += txn
            self.pending_transactions += 1
            self.pending_txns[self.txn_xid] = [m.id for m in txn]
            if self.unconfirmed.commit_time is None:
                self.unconfirmed.commit_time = self.txn_commit
        self.pending_end = max(self.pending_end, end_lsn)
        self.received = max(self.received, end_lsn)
        self.txn = None
        if len(self.pending) >= self.options.batch_size:
            self.publish()
            self.marks()

    def _keepalive(self, reply: bool) -> None:
        """After the keepalives of one wake-up: with nothing of ours in flight, everything
        that commits before the server's position has been sent, so the slot may move up to
        it — at most once per IDLE_CONFIRM_S unless the server asks for a reply: while other
        databases write, the walsender pings on every WAL flush it reads past the confirmed
        position, and confirming each ping made an idle relay send status updates at the
        server's commit rate. Otherwise only a requested reply is sent. (Answering every
        keepalive with the received position as written stops the walsender's repeated
        pings, but measured no cheaper: one status update per transaction instead of ~one
        more keepalive, and each update wakes the walsender; docs/relay.md.)"""
        now = time.monotonic()
        if (
            not self.in_flight
            and self.received > self.confirmed
            and (reply or now - self.last_idle_confirm >= IDLE_CONFIRM_S)
        ):
            self.last_idle_confirm = now
            self.confirmed = self.received
            self._status(self.confirmed)
            self.stats.add(idle_confirms=1)
            self.stats.confirmed_lsn = self.confirmed
        elif reply:
            self._status(self.confirmed)

    def publish(self) -> None:
        """Publish the pending transactions and wait for the broker's acknowledgement."""
        messages, observer = self.pending, self.observer
        if messages:
            careful = max(self.acked_end, self.confirmed) < self.careful_until
            self.delivery.deliver(messages, careful=careful)
            self.acked += [m.id for m in messages]
            self.acked_txns.update(self.pending_txns)
            self.pending_txns = {}
            stats = self.stats
            stats.published += len(messages)  # this thread is the only writer
            stats.batches += 1
            stats.transactions += self.pending_transactions
            observer.published(len(messages))
            # From the batch's first frame (or the open transaction's) to the acknowledgement.
            started = self.linger_from
            observer.batch_seconds(time.monotonic() - started if started else 0.0)
            observer.heartbeat(0)
            self.pending = []
            self.pending_transactions = 0
        self.acked_end = max(self.acked_end, self.pending_end)
        # A transaction begun and not complete lingers from its own first frame.
        self.linger_from = self.txn_began if self.txn is not None else None

    def marks(self) -> None:
        """Collect the mark in flight (confirming what it covers), then send the next one
        when due. Never waits, except when `MARK_MAX_IDS` ids pile up behind a mark in
        flight (the server is slower than the stream: the stream waits rather than let the
        re-sent-after-a-crash window grow without bound)."""
        marks, options = self.mark_session, self.options
        if self.marking_end is not None:
            if not marks.done():
                if len(self.acked) < MARK_MAX_IDS:
                    return
                marks.wait()
            self._marked(self.marking_end)
            self.marking_end = None
        if self.acked_end <= self.confirmed:
            return
        now = time.monotonic()
        if (
            options.mark
            and now - self.last_mark < options.mark_interval_s
            and len(self.acked) < MARK_MAX_IDS
        ):
            return
        self.last_mark = now
        acked, self.acked = self.acked, []
        self.marking_txns, self.acked_txns = self.acked_txns, {}
        if marks.send(acked, self.marking_txns):  # rows whose mark failed are tried first
            self.marking_end = self.acked_end
        else:  # nothing to mark (--no-mark, or transactions without outbox rows)
            self.marking_txns = {}
            self._confirm_marked(self.acked_end)

    def flush(self, *, settle: bool = False) -> None:
        """Mark everything acknowledged and confirm it, waiting for the server. `settle`
        (caught up): first try each row whose mark failed until it is marked or
        dead-lettered; a stop leaves it unconfirmed instead (re-streamed at the next start)."""
        marks = self.mark_session
        if self.marking_end is not None:
            marks.wait()
            self._marked(self.marking_end)
            self.marking_end = None
        for attempt in range(FLUSH_MARK_TRIES):
            if self.acked_end <= self.confirmed:
                return
            if attempt:
                time.sleep(FLUSH_RETRY_S)  # a transaction still ending on the server
            self.marking_txns, self.acked_txns = self.acked_txns, {}
            marks.mark(self.acked, self.marking_txns)
            self.acked = []
            if settle:
                marks.settle(self.stop)
            if self._marked(self.acked_end):
                return

    def _marked(self, lsn: int) -> bool:
        """A mark committed: confirm up to `lsn` (`_confirm_marked`) — unless its snapshot
        did not show some of its transactions yet (relay/cdc/marks.py): their rows may be
        unmarked, so their ids go into the next mark and nothing is confirmed meanwhile (a
        crash re-streams them). True when the mark saw everything it covered."""
        txns, self.marking_txns = self.marking_txns, {}
        unseen = self.mark_session.unseen
        if unseen:
            for xid in unseen:
                ids = txns.get(xid, [])
                self.acked_txns[xid] = ids
                self.acked += ids
            self.stats.add(remarks=1)
            return False
        self._confirm_marked(lsn)
        return True

    def _confirm_marked(self, lsn: int) -> None:
        """Confirm up to `lsn`, everything before it being marked — unless a row of an
        earlier mark is neither marked nor dead-lettered yet (relay/cdc/mark_repair.py): then
        the slot stays where it is, and a crash re-streams that row. The rows after it are
        marked meanwhile; the position moves on once it is settled."""
        if not self.mark_session.unresolved:
            self._confirm(lsn)

    def _confirm(self, lsn: int) -> None:
        if lsn <= self.confirmed:
            return
        self.confirmed = lsn
        self._status(lsn)
        self.stats.confirmed_lsn = lsn
        self.unconfirmed.commit_time = None
        self.observer.heartbeat(0)

    def _status(self, lsn: int, *, reply: bool = False) -> None:
        self.stream.confirm(lsn, reply=reply, received=self.received)
        self.last_status = time.monotonic()
