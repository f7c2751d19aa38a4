"""One replication connection's stream loop: transactions in, batches out, positions back.

The state machine behind `CdcRelay` (docs/relay.md, "CDC mode"); it imports nothing of the
relay that owns it. Confirmation trails the marks, never the other way round.
"""

from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass, field

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

FLUSH_MARK_TRIES = 20
"""A stop's last mark is tried again while its snapshot misses some of its transactions;
then the slot is left unconfirmed past them (re-streamed)."""
FLUSH_RETRY_S = 0.05


@dataclass(eq=False, kw_only=True)
class StreamSession:
    """Reads one stream until the relay stops (or, `until_caught_up`, catches up)."""

    stream: ReplicationStream
    options: CdcOptions
    builder: MessageBuilder
    delivery: Delivery
    mark_session: MarkSession
    stats: CdcStats
    observer: Observer
    stop: threading.Event
    target_lsn: int
    unconfirmed: Unconfirmed
    careful_until: int = 0
    """Before this position batches count their attempts first (relay/cdc/relay.py)."""
    relations: dict[int, Columns | None] = field(default_factory=dict, init=False)
    txn: list[Message] | None = field(default=None, init=False)
    txn_commit: int = field(default=0, init=False)
    txn_xid: int = field(default=0, init=False)
    txn_began: float = field(default=0.0, init=False)
    pending: list[Message] = field(default_factory=list, init=False)
    """Messages of complete transactions received and not yet published."""
    pending_transactions: int = field(default=0, init=False)
    pending_txns: dict[int, list[MessageId]] = field(default_factory=dict, init=False)
    """The ids of `pending` by transaction (xid): what a mark must see."""
    pending_end: int = field(default=0, init=False)
    """End of the last complete transaction received (with or without outbox rows)."""
    linger_from: float | None = field(default=None, init=False)
    """When the first frame of what waits to be published arrived (None: nothing waits)."""
    acked: list[MessageId] = field(default_factory=list, init=False)
    """Acknowledged ids not yet sent in a mark."""
    acked_txns: dict[int, list[MessageId]] = field(default_factory=dict, init=False)
    """`acked` by transaction; `marking_txns`: those of the mark in flight."""
    marking_txns: dict[int, list[MessageId]] = field(default_factory=dict, init=False)
    acked_end: int = field(default=0, init=False)
    marking_end: int | None = field(default=None, init=False)
    """End of the last transaction the mark in flight covers (None: none in flight)."""
    confirmed: int = field(default=0, init=False)
    received: int = field(default=0, init=False)
    """The furthest position the server said it sent (keepalives, commits): reported as
    written, never as flushed."""
    last_status: float = field(default_factory=time.monotonic, init=False)
    last_mark: float = field(default_factory=time.monotonic, init=False)
    last_idle_confirm: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        spec = self.builder.spec
        self.partition = (spec.schema, spec.unpublished_partition)

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
                received: list[bytes] | None = drain()
                if not received and linger and self.linger_from is not None:
                    received = self._linger(self.linger_from + linger)
                    if received is None:
                        continue  # slept: what arrived meanwhile is taken now
                if received:
                    frames(received)
                    continue
                # Nothing buffered, the linger over: publish, move the marks on, then wait.
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
        except (SinkUnavailable, Interrupted):  # a broker outage, or stopped inside retries
            # Re-read from the confirmed position: settle what was acked, not to resend it.
            self.flush()
            raise

    def _linger(self, until: float) -> list[bytes] | None:
        """The frames the socket already holds; else a sleep until `until` that does not watch
        the socket (each wake-up costs more than its frames): None. []: publish now."""
        self.stream.receive()
        received = self.stream.drain()
        if not received:
            remaining = until - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)
                return None
        return received

    def _sleep_while_busy(self, linger: float) -> None:
        """After a lingered batch, sleep one linger rather than wake for the next packet (one
        wake-up per linger, not two); what arrives meanwhile is published at its end."""
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
        """Act on one wake-up's frames, decoded in place, the common messages first: this
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
                        _, self.txn_commit, self.txn_xid = pgoutput.BEGIN.unpack_from(data, 26)
                        self.txn_began = now
                        if self.linger_from is None:
                            self.linger_from = now
                    elif kind == 0x43:  # 'C': flags, commit LSN, then the end LSN
                        self._commit(pgoutput.COMMIT.unpack_from(data, 26)[2])
                    elif kind == 0x52:  # 'R'
                        self._relation(pgoutput.decode_at(data, 25))
                    # Origin, Type, Update, Delete, Truncate, logical messages: not ours
                elif tag == 0x6B:  # 'k'
                    wal_end, _sent, requested = pgoutput.KEEPALIVE.unpack_from(data, 1)
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
        """With nothing of ours in flight, the slot may move to the server's position — at
        most once per IDLE_CONFIRM_S unless asked: the walsender pings on every WAL flush of
        other databases, and answering each would follow the server's commit rate."""
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
            started = self.linger_from
            observer.batch_seconds(time.monotonic() - started if started else 0.0)
            observer.heartbeat(0)
            self.pending = []
            self.pending_transactions = 0
        self.acked_end = max(self.acked_end, self.pending_end)
        self.linger_from = self.txn_began if self.txn is not None else None

    def marks(self) -> None:
        """Collect the mark in flight, then send the next one when due. Waits only when
        `MARK_MAX_IDS` ids pile up behind it, bounding what a crash would re-send."""
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
        """Mark and confirm everything acknowledged, waiting. `settle` (caught up): settle
        failed marks first; a stop leaves them unconfirmed (re-streamed)."""
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
        """A mark committed: confirm up to `lsn`, unless its snapshot missed some of its
        transactions: their ids go into the next mark, nothing confirmed meanwhile. True when
        it saw everything."""
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
        """Confirm up to `lsn` unless a failed mark's row is not yet settled
        (relay/cdc/marks.py): a crash then re-streams it."""
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
