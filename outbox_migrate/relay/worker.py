"""The relay's worker loop: claim → publish → mark, with a clean lifecycle.

Each worker is a thread with its own connection and its own sink. One batch is one
transaction: claim rows (`FOR UPDATE SKIP LOCKED`, this session's shards only), publish them
and wait for the broker's acknowledgement, mark the acknowledged ones, commit. Nothing is
marked before the broker acknowledged it, so a crash anywhere re-sends at most the batch in
flight (at-least-once). Failures are sorted, never swallowed:

* SQLSTATE 40001 (row moved to another partition by a concurrent mark): retried at once
  after a short jitter — the shard scheme makes it rare, the retry makes it harmless;
* a lost connection: reconnect with exponential backoff (shards are re-acquired);
* the sink unavailable: the batch rolls back, the worker backs off and retries, forever;
* messages the sink rejects: attempts are counted; after `max_attempts` the row goes to the
  dead-letter table and is marked in the same transaction (nothing lost).

`Relay.stop()` (SIGTERM in the CLI) lets every worker finish its in-flight batch; after
`shutdown_timeout_s` the rest are abandoned before their mark (their rows are re-sent later).
Log lines start with stable event names (`relay.started`, `relay.switched`, …).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from psycopg.errors import IntegrityError

from outbox_migrate.config import OutboxSpec
from outbox_migrate.db import APPLICATION_NAME
from outbox_migrate.relay import (
    claimed,
    keepalive,
    library_logs,
    mark_repair,
    notify,
    publishing,
    queries,
    read_ahead,
    wire,
)
from outbox_migrate.relay.backoff import backoff_s, jitter_s
from outbox_migrate.relay.bad_rows import FailedMessages
from outbox_migrate.relay.batch import Batch, Commit, mark_and_commit
from outbox_migrate.relay.columns import resolve as resolve_columns
from outbox_migrate.relay.cursor import Cursor, NoCursor
from outbox_migrate.relay.errors import RelayFailed, SinkUnavailable
from outbox_migrate.relay.fencing import Fence, LeaseUnproven
from outbox_migrate.relay.idle_flag import SPARSE_ROWS, Idle, IdleFlag
from outbox_migrate.relay.listener import Listener
from outbox_migrate.relay.message import Message, MessageId, TextIdMessage
from outbox_migrate.relay.metrics import METRICS_INTERVAL_S, Observer
from outbox_migrate.relay.options import Mode, Ordering, RelayOptions
from outbox_migrate.relay.outage_wait import back_off_keeping_session
from outbox_migrate.relay.parking import PARKED_BATCH_WAIT_S, Parking
from outbox_migrate.relay.shards import UNTIL_EMPTY_PATIENCE_CHECKS, ShardLease, home_shards
from outbox_migrate.relay.sinks import Sink, SinkFactory
from outbox_migrate.relay.switching import SourceState
from outbox_migrate.relay.waits import Session, Waits

log = logging.getLogger("outbox_migrate.relay")

RELAY_APPLICATION_NAME = f"{APPLICATION_NAME} relay"
ABANDON_GRACE_S = 2.0
"""After the shutdown timeout: how long abandoned workers get to roll back and exit."""
HOLD_S = 0.05
"""How long an idle worker leaves its last COMMIT's result unread for the next claim to read
with its own; then it reads it (see `_Worker._hold`)."""
REAP_MARGIN_S = 0.5
"""Past the server's own idle-session bound (session timeout + poll interval) before the
survivors end a silent shard holder themselves (`ShardLease.reap`)."""


@dataclass
class RelayStats:
    """What a run did; read it after `run()` returns (or live, for tests)."""

    published: int = 0
    batches: int = 0
    serialization_retries: int = 0
    connection_retries: int = 0
    sink_failures: int = 0
    rejected: int = 0
    bad_rows: int = 0
    """Failures of a row itself (relay/claimed.py, an unrepresentable message, a mark that
    violates a constraint): counted like rejections, without the backoff."""
    dead_lettered: int = 0
    switches: int = 0
    abandoned_workers: int = 0
    read_ahead: int = 0
    """Batches claimed on a worker's read-ahead session while the one before was published."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def batch(self, published: int) -> None:
        """One batch committed (the per-batch path: no keyword dispatch)."""
        with self._lock:
            self.published += published
            self.batches += 1

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


class _Abandoned(Exception):
    """Raised inside a worker's transaction after the shutdown timeout: roll back, exit."""


class Relay:
    """Publishes an outbox (flat, partitioned, or switching between them) through a sink."""

    def __init__(
        self,
        dsn: str,
        sink_factory: SinkFactory,
        *,
        spec: OutboxSpec | None = None,
        options: RelayOptions | None = None,
        observer: Observer | None = None,
        application_name: str = RELAY_APPLICATION_NAME,
    ) -> None:
        self.dsn = dsn
        self.spec = spec or OutboxSpec()
        self.options = options or RelayOptions()
        self.sink_factory = sink_factory
        self.observer = observer or Observer()
        self.application_name = application_name
        self.state = SourceState(
            self.spec, self.options.mode, self.options.switch_gate, self.options.old_app_name
        )
        self.stats = RelayStats()
        self._stop = threading.Event()
        self._abandon = threading.Event()
        self._wake_fds: tuple[int, int] | None = None
        """A pipe a stop writes to: idle workers wait on it beside their own session."""
        self._wake_lock = threading.RLock()
        """Guards the pipe's closing; re-entrant, as a signal handler may call `stop` on the
        thread that holds it."""
        self._columns: dict[str, queries.Columns] = {}
        self._text_ids = self.spec.id_kind == "application"
        """Application ids (uuid, ULID) travel as text: claimed in order, no id cursor."""
        self._id: Callable[[Any], MessageId] = str if self._text_ids else int
        self._message: type[Message] = TextIdMessage if self._text_ids else Message
        options = self.options
        self.failures = FailedMessages(
            self.spec.schema, options.dead_letter_table, options.attempts_table,
            options.max_attempts, self._text_ids,
        )  # fmt: skip
        """Attempts counted in the database, dead letters (relay/bad_rows.py)."""
        self._suspects = mark_repair.Suspects()
        """Rows whose mark failed, marked alone when they come back (mark_repair.py)."""
        self._parking = Parking()
        """Keys waiting for a rejected message (`--ordering key` only; see parking.py)."""
        self._conns: dict[int, Any] = {}
        self._fatal: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask every worker to finish its in-flight batch and exit (thread- and signal-safe)."""
        self._stop.set()
        with self._wake_lock:
            fds = self._wake_fds
            if fds is not None:
                with contextlib.suppress(OSError):  # full: a byte is there already
                    os.write(fds[1], b"x")

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> RelayStats:
        """Run the workers until `stop()` (or, with `until_empty`, until nothing is left)."""
        library_logs.route()
        self._check_sink()
        self._prepare()
        options = self.options
        log.info(
            "relay.started mode=%s workers=%d shards=%d batch=%d",
            options.mode, options.workers, options.shard_count, options.batch_size,
        )  # fmt: skip
        threads = [
            threading.Thread(target=self._worker, args=(i,), name=f"relay-{i}", daemon=True)
            for i in range(options.workers)
        ]
        helpers: list[threading.Thread] = []
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._wake_fds = (read, write)
        if type(self.observer) is not Observer:
            helpers.append(threading.Thread(target=self._sample, name="relay-sample", daemon=True))
        for thread in threads + helpers:
            thread.start()
        try:
            while any(t.is_alive() for t in threads) and not self._stop.is_set():
                for thread in threads:
                    thread.join(timeout=0.2)
        finally:
            self.stop()
            self._shutdown(threads)
            for helper in helpers:
                helper.join(timeout=2.0)
            self._close_wake_pipe()
        self.stats.switches = self.state.switches
        if self._fatal is not None:
            # A fault met while running is a failure (exit 1), not bad input (exit 2): what
            # could be refused before work started was refused by `_prepare`.
            if isinstance(self._fatal, RelayFailed):
                raise self._fatal
            raise RelayFailed(f"relay worker failed: {_one_line(self._fatal)}") from self._fatal
        log.info("relay.stopped %s", " ".join(f"{k}={v}" for k, v in self.stats.as_dict().items()))
        return self.stats

    def _close_wake_pipe(self) -> None:
        with self._wake_lock:
            fds, self._wake_fds = self._wake_fds, None
            if fds is not None:
                for fd in fds:
                    os.close(fd)

    def wake_fd(self) -> int | None:
        """The read end of the stop pipe (readable once `stop` was called), while running."""
        fds = self._wake_fds
        return None if fds is None else fds[0]

    def _shutdown(self, threads: list[threading.Thread]) -> None:
        deadline = time.monotonic() + self.options.shutdown_timeout_s
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        late = [t for t in threads if t.is_alive()]
        if not late:
            return
        # The in-flight batch did not finish in time: abandon it before its mark. A running
        # query is cancelled; a worker waiting on the broker rolls back when the call returns.
        self._abandon.set()
        self.stats.add(abandoned_workers=len(late))
        log.warning("relay.shutdown_timeout workers=%d", len(late))
        for conn in list(self._conns.values()):
            try:
                conn.cancel_safe(timeout=1.0)
            except Exception:  # best effort: the connection is in use elsewhere
                log.debug("relay.cancel_failed", exc_info=True)
        for thread in late:
            thread.join(timeout=ABANDON_GRACE_S)

    def _check_sink(self) -> None:
        """Build one sink and close it: a configuration error (bad URL scheme, an option the
        sink refuses, a missing client library) is a `RelayError` here, at start — one line,
        exit 2 — rather than a worker failure, or an "outage" retried for ever, later."""
        self._close_sink(self.sink_factory())

    def _prepare(self) -> None:
        """Check the tables and resolve optional columns once, before any worker starts."""
        from outbox_migrate.db import connect

        with connect(self.dsn, application_name=self.application_name) as conn:
            sources = [self.state.current]
            if self.options.mode is Mode.switching:
                sources = [self.state.flat, self.state.partitioned]
            options = self.options
            for source in sources:
                self._columns[source.label] = resolve_columns(conn, source, self.spec,
                    options.key_column, options.event_type_column, options.ordering)  # fmt: skip
            # The dead-letter and attempts tables, created up front (relay/bad_rows.py).
            if not self.failures.prepare(conn, [source.label for source in sources]):
                log.warning(
                    "relay.dead_letter_unavailable: create %s and %s as in docs/relay.md; "
                    "until then a rejected message stops the relay",
                    options.dead_letter_table, options.attempts_table,
                )  # fmt: skip
            if self.options.listen and self.options.mode is not Mode.flat:
                self._check_trigger_key(conn)

    def _check_trigger_key(self, conn: Any) -> None:
        """A wake-up trigger installed under the table's old name uses another idle lock key:
        it would never see this relay idle, so plain INSERTs would wait for the poll."""
        if notify.key_matches(conn, self.spec) is False:
            log.warning(
                "relay.notify_trigger_stale table=%s: the wake-up trigger was installed for "
                "another table name (renamed since?); reinstall it with relay --install-notify",
                notify.label(self.spec),
            )

    # -- the worker loop -------------------------------------------------------------------

    def _worker(self, index: int) -> None:
        _Worker(self, index).run()

    def _backoff(self, failures: int) -> float:
        return backoff_s(
            failures, base_s=self.options.backoff_base_s, cap_s=self.options.backoff_cap_s
        )

    def _nothing_left(self, conn: Any) -> bool:
        """`until_empty`: this worker's table is empty; in switching mode, wait for the switch
        unless the partitioned table is empty too (nothing to publish either way)."""
        if self.state.mode is not Mode.switching or self.state.switched:
            return True
        row = conn.execute(queries.has_unpublished(self.state.partitioned)).fetchone()
        return not (row and row[0])

    def _publish(
        self,
        conn: Any,
        sink: Sink,
        source: queries.Source,
        batch: list[Message],
        bad: list[claimed.BadRow],
        after: MessageId = 0,
    ) -> tuple[list[MessageId], list[MessageId], list[MessageId], float, MessageId | None]:
        """Publish; returns (acknowledged ids to mark, dead-lettered ids, bad rows to try again
        by id, how long the worker pauses once this batch's transaction has ended, the id to
        claim again from). The pause is a backoff by the most attempts any message the sink
        refused has had; the worker then claims again from the lowest message to retry. With
        `--ordering key` a failure parks its key instead (parking.py): no pause, later messages
        of that key wait while the others flow; a released key's held-back messages lie below
        the cursor, which claims again from the lowest of them (`after`: where the claim
        started).

        `bad`: rows of the batch that could not become a message (relay/claimed.py); they and
        messages the sink cannot represent count attempts like a rejection, without the
        backoff — the row itself is at fault, waiting changes nothing.

        The pause is the worker's to take after its COMMIT, never here: a session that waits
        inside its transaction is "idle in transaction" on the claimed rows' locks, and the
        migration runner does not queue a step's lock behind such a session."""
        parking, label = self._parking, source.label
        claim = sorted(batch + [b.message for b in bad], key=_BY_ID) if bad else batch
        last = claim[-1].id if claim else None
        if parking:  # only ever non-empty with key ordering
            send = parking.withhold(label, claim, now=time.monotonic(), after=after)[0]
            if not send:  # every message waits for its key; others would have been sent
                return [], [], [], PARKED_BATCH_WAIT_S, None  # no busy loop of rescans meanwhile
            if len(send) < len(claim):
                free = {m.id for m in send}
                batch = [m for m in batch if m.id in free]
                bad = [b for b in bad if b.message.id in free]
        rejected, unrepresentable = publishing.publish(sink, batch)
        failures = self.failures
        if not (rejected or unrepresentable or bad):
            acked = [m.id for m in batch]
            # A message that failed before went through this time: its counter goes.
            self._forget(conn, label, acked)
            if parking:
                settled = parking.settle(label, batch, {}, now=time.monotonic(),
                                         backoff=self._backoff, last=last)  # fmt: skip
                return acked, [], [], 0.0, settled.claim_again_from
            return acked, [], [], 0.0, None
        reasons = {b.message.id: b.reason for b in bad}
        reasons.update(unrepresentable)
        reasons.update(rejected)
        refused = [m for m in batch if m.id in reasons] + [b.message for b in bad]
        self._count_failures(len(rejected), len(reasons) - len(rejected))
        verdict = failures.record(conn, label, refused, reasons)
        self.stats.add(dead_lettered=len(verdict.dead))
        acked = [m.id for m in batch if m.id not in reasons]
        self._forget(conn, label, acked)
        log.warning("relay.rejected count=%d bad_rows=%d dead_lettered=%d",
                    len(rejected), len(reasons) - len(rejected), len(verdict.dead))  # fmt: skip
        dead_ids = [m.id for m in verdict.dead]
        if self.options.ordering is Ordering.key:
            settled = parking.settle(
                label, sorted(batch + [b.message for b in bad], key=_BY_ID),
                {i: verdict.attempts[i] for i in verdict.retry},
                now=time.monotonic(), backoff=self._backoff, last=last,
            )  # fmt: skip
            held = settled.held
            return [i for i in acked if i not in held], dead_ids, [], 0.0, settled.claim_again_from
        most = max((verdict.attempts[i] for i in verdict.retry if i in rejected), default=0)
        # Rejected messages are claimed again after a backoff that grows with their attempts,
        # not at once: a transient refusal gets time to clear before the message counts
        # towards the dead-letter table. A bad row is tried again without waiting.
        pause = self._backoff(most - 1) if most else 0.0
        rewind = min(verdict.retry) if pause else None
        return acked, dead_ids, verdict.retry, pause, rewind

    def _count_failures(self, rejected: int, bad: int, dead: int = 0) -> None:
        self.stats.add(rejected=rejected, bad_rows=bad, dead_lettered=dead)
        for reason, count in (("rejected", rejected), ("bad_row", bad)):
            if count:
                self.observer.failed(reason, count)

    def _forget(self, conn: Any, label: str, acked: list[MessageId]) -> None:
        """A message that failed before went through: its counter goes — unless its mark
        failed before, which is yet to be tried (`_Worker._mark_suspects`)."""
        seen = self.failures.seen_before(label, acked)
        if seen and self._suspects:
            pending = self._suspects.among(label, seen)
            seen = [i for i in seen if i not in pending]
        self.failures.forget(conn, label, seen)

    # -- helpers threads ------------------------------------------------------------------

    def _sample(self) -> None:
        """Sample backlog size and oldest unpublished age for the metrics."""
        from outbox_migrate.db import connect
        from outbox_migrate.errors import ConnectError

        while not self._stop.is_set():
            try:
                with connect(self.dsn, application_name=self.application_name) as conn:
                    while not self._stop.is_set():
                        source = self.state.current
                        row = conn.execute(
                            queries.backlog(source, self._columns[source.label])
                        ).fetchone()
                        if row:
                            self.observer.backlog(int(row[0]), float(row[1]))
                        self._stop.wait(METRICS_INTERVAL_S)
            except _connection_errors(ConnectError):
                self._stop.wait(METRICS_INTERVAL_S)

    def _close_sink(self, sink: Sink | None) -> None:
        if sink is not None:
            try:
                sink.close()
            except Exception:  # a broken sink is replaced, not fatal
                log.debug("relay.sink_close_failed", exc_info=True)

    def _close_conn(self, index: int, conn: Any) -> None:
        self._conns.pop(index, None)
        if conn is not None:
            try:
                conn.close()
            except Exception:  # closing a broken connection may fail too
                log.debug("relay.close_failed", exc_info=True)


def _connection_errors(*more: type[BaseException]) -> tuple[type[BaseException], ...]:
    import psycopg

    return (psycopg.OperationalError, psycopg.InterfaceError, *more)


def _connect_worker(relay: Relay) -> Any:
    """A worker session: the relay's application name, keepalives for its session timeout."""
    from outbox_migrate.db import connect

    return connect(
        relay.dsn,
        application_name=relay.application_name,
        params=keepalive.libpq_params(relay.options.dead_session_s),
    )


def _serialization_errors() -> type[BaseException]:
    import psycopg

    return psycopg.errors.SerializationFailure


def _one_line(exc: BaseException) -> str:
    from outbox_migrate.db import one_line

    return one_line(str(exc))


class _Worker:
    """One worker thread's state: its session, sink, shards and id cursor."""

    def __init__(self, relay: Relay, index: int) -> None:
        options = relay.options
        table = relay.state.flat if options.mode is Mode.flat else relay.state.partitioned
        self.relay = relay
        self.index = index
        self.lease = ShardLease(
            key=f"{queries.ADVISORY_NAMESPACE}:{table.label}",
            shards=options.shard_count,
            home=home_shards(index, options.workers, options.shard_count),
            reap_after_s=(
                options.dead_session_s + options.poll_interval_s + REAP_MARGIN_S
                if options.dead_session_s > 0
                else None
            ),
        )
        self.conn: Any = None
        self.rendered: dict[tuple[str, bool], tuple[bytes, bytes, bytes]] = {}
        """Claim and mark statements rendered for this session (see `_statements`)."""
        self.wire: wire.Wire | None = None
        """The session's libpq-level pipeline of prepared statements (relay/wire.py)."""
        self.sink: Sink | None = None
        self.failures = 0
        self.pause_s = 0.0
        """Wait before the next claim: the sink rejected messages that are to be retried."""
        self.fence = Fence(options.dead_session_s, options.sink_timeout_s)
        """Whether a batch may still be handed to the sink (relay/fencing.py)."""
        self.cursor: Cursor = (
            NoCursor(now=time.monotonic())
            if relay._text_ids
            else Cursor(
                shards=options.shard_count,
                mine=[],
                track_gaps=options.ordering is not Ordering.key,
                now=time.monotonic(),
            )
        )
        self.flag = IdleFlag(options.listen and not options.until_empty, options.linger_s)
        """The idle flag's state (relay/idle_flag.py; the lock itself: relay/notify.py)."""
        self.blocked = False
        """The last idle wait blocked before it returned (`Listener.poll`)."""
        self.rewound = False
        """The last batch set the cursor back to a row to try again (no read-ahead then)."""
        self.later: list[MessageId] = []
        """Bad rows to try again once the backlog is drained (`_retry_bad_rows`)."""
        self.unmarked: list[Commit] = []
        """Batches of the last failed run whose mark did not commit (`_repair_marks`)."""
        self.mark_failure: IntegrityError | None = None
        """The constraint a mark broke: the next step repairs `unmarked` first."""
        self.read_ahead = read_ahead.ReadAhead(
            read_ahead.open_session(
                lambda: _connect_worker(relay), options.dead_session_s, options.poll_interval_s
            )
        )
        """The worker's second session, claiming the next batch while one is published."""
        # Every wait of this worker goes through it: none with a session in a transaction.
        self.waits = Waits(relay._stop, self._sessions)
        self.listener = Listener(lambda: _connect_worker(relay), options.channel,
                                 relay.wake_fd, self.waits, self.cursor.notified_payloads,
                                 index)  # fmt: skip

    def _sessions(self) -> tuple[Session, Session]:
        return (self.conn, self.wire), (self.read_ahead.conn, self.read_ahead.pipe)

    def run(self) -> None:
        relay = self.relay
        try:
            while not relay.stopping:
                relay.observer.heartbeat(self.index)
                if self._step_guarded():
                    return
        except _Abandoned:
            log.warning("relay.batch_abandoned worker=%d", self.index)
        except Exception as exc:
            # Not a failure the loop knows how to retry (a sink that cannot be built, a bug):
            # stop the whole relay and let run() report it, rather than die silently.
            log.error("relay.worker_failed worker=%d %s", self.index, exc,
                      exc_info=log.isEnabledFor(logging.DEBUG))  # fmt: skip
            if relay._fatal is None:
                relay._fatal = exc
            relay.stop()
        finally:
            relay.observer.worker_done(self.index)
            relay._close_sink(self.sink)
            if self.conn is not None and not self.conn.closed:
                try:
                    self.lease.release_all(self.conn)
                except Exception:  # the session is closing anyway
                    log.debug("relay.release_failed", exc_info=True)
            relay._close_conn(self.index, self.conn)
            self.listener.close()
            relay._conns.pop(_ahead_key(self.index), None)
            self.read_ahead.close()

    def _step_guarded(self) -> bool:
        """One loop iteration with its failures sorted. True = this worker is done."""
        from outbox_migrate.errors import ConnectError

        relay = self.relay
        try:
            if self.mark_failure is not None:
                self._repair_marks()
            return self._step()
        except LeaseUnproven as exc:
            relay.observer.failed("fenced")
            log.warning("relay.fenced worker=%d %s", self.index, exc)
        except SinkUnavailable as exc:
            relay.stats.add(sink_failures=1)
            relay.observer.failed("sink")
            log.warning("relay.sink_unavailable worker=%d %s", self.index, exc)
            relay._close_sink(self.sink)
            self.sink = None
            self._step_out()
            self._back_off(keep_session=True)
        except IntegrityError as exc:
            # The mark of a published batch broke a constraint (a duplicate id moving into
            # the published partition): the next step finds the rows at fault, marks the rest.
            if not self.unmarked:
                raise  # no batch to repair: not a mark's failure
            self.mark_failure = exc
        except _serialization_errors():
            # Another claimer moved a row we were about to lock (see queries.py). Checked
            # before connection errors: SerializationFailure is an OperationalError too, but
            # the session is fine.
            relay.stats.add(serialization_retries=1)
            relay.observer.failed("serialization")
            self.waits.wait(jitter_s())
        except _connection_errors(ConnectError) as exc:
            relay.stats.add(connection_retries=1)
            relay.observer.failed("connection")
            log.warning("relay.connection_lost worker=%d %s", self.index, _one_line(exc))
            self._forget_session()
            self._back_off()
        return False

    def _repair_marks(self) -> None:
        """After a mark failed on a constraint: mark the acknowledged rows of the batches it
        took down (relay/mark_repair.py); a row that cannot be marked is a bad row — counted,
        claimed again, dead-lettered and removed after `max_attempts`. Run as a step of its
        own, so a lost session or a 40001 meanwhile is handled as anywhere else (the repair
        is one transaction per batch; without a session, the rows are claimed and sent again)."""
        relay, exc = self.relay, self.mark_failure
        assert exc is not None
        if self.conn is None or self.conn.closed:
            self.unmarked, self.mark_failure = [], None
            return
        while self.unmarked:
            claim = self.unmarked[0].batch
            source, rows, batch, acked = claim.source, claim.rows, claim.messages, claim.acked
            by_key = relay.options.ordering is Ordering.key
            try:
                done = mark_repair.repair(self.conn, source, relay.failures, relay._suspects,
                                          rows, batch, acked, exc, by_key=by_key)  # fmt: skip
            except IntegrityError as failed:  # the repair itself broke one: no loop of repairs
                raise RelayFailed(f"repairing a failed mark: {_one_line(failed)}") from failed
            self.unmarked.pop(0)
            mark_repair.park(relay._parking, source.label, batch, done, relay._backoff,
                             by_key=by_key)  # fmt: skip
            relay.stats.batch(done.marked)
            relay._count_failures(0, len(done.bad), dead=len(done.dead))
            relay.observer.published(done.marked)
            self.later += done.retry
            log.warning(
                "relay.mark_repaired worker=%d marked=%d bad_rows=%d dead_lettered=%d %s",
                self.index, done.marked, len(done.bad), len(done.dead), _one_line(exc),
            )  # fmt: skip
        self.mark_failure = None

    def _step_out(self) -> None:
        """The broker is out of reach: let the other relays serve this worker's shards while
        it backs off (it rejoins at its next lease check)."""
        if self.conn is None or self.conn.closed:
            return
        try:
            self.lease.step_out(self.conn)
        except _connection_errors():  # the session is gone: so are its locks
            log.debug("relay.step_out_failed", exc_info=True)

    def _forget_session(self) -> None:
        """Drop a lost session (its shard locks died with it): `_step` opens a new one."""
        self.relay._close_conn(self.index, self.conn)
        self.listener.close()
        self.conn = None
        self.lease.lost()

    def _back_off(self, *, keep_session: bool = False) -> None:
        """`keep_session` (the broker is away, PostgreSQL is not): the session is kept alive
        through the wait, or dropped before the wake-up when it was lost anyway, so that the
        wake-up tries the broker instead of failing on a dead session (relay/outage_wait.py)."""
        delay = self.relay._backoff(self.failures)
        self.failures += 1
        conn = self.conn
        if keep_session and conn is not None and not conn.closed:
            if not back_off_keeping_session(self.waits.wait, delay, conn):
                log.info("relay.session_reopened worker=%d (ended during the backoff)", self.index)
                self._forget_session()
            return
        self.waits.wait(delay)

    def _step(self) -> bool:  # noqa: PLR0911 - one return per reason the loop ends or waits
        relay, options, lease = self.relay, self.relay.options, self.lease
        if self.conn is None:
            timeout_s = options.dead_session_s
            self.conn = _connect_worker(relay)
            keepalive.configure_session(self.conn, timeout_s, options.poll_interval_s)
            self.fence.lost()
            # The planner cannot know that `mod(id, n) = ANY(mine)` keeps 1/n of the rows; it
            # guesses 0.5 % and picks "scan the whole partition, then sort" over walking the
            # id index — 40 ms instead of 0.5 ms per claim at 100k rows. Every statement of
            # this session wants index order, so sorting is ruled out for the session.
            self.conn.execute(queries.claim_session_settings())
            self.rendered.clear()
            # The hot path prepares its own statements (relay/wire.py). psycopg's automatic
            # preparing stays off on this session: with statements of its own prepared, a
            # ROLLBACK through psycopg makes it send DEALLOCATE ALL, which would take ours too.
            self.conn.prepare_threshold = None
            self.wire = wire.Wire(self.conn)
            self._listen()
            relay._conns[self.index] = self.conn
            lease.lost()
            self.flag.session_lost()
        if self.sink is None:
            self.sink = relay.sink_factory()
        now = time.monotonic()
        checks = lease.checks
        if lease.maintain(self.conn, now=now):
            self.cursor.reset(lease.mine(), now)
        if lease.checks != checks:
            relay.observer.lease_checked(self.index, len(lease.owned))
        if not lease.owned:
            if options.until_empty and (
                not lease.home or lease.checks >= UNTIL_EMPTY_PATIENCE_CHECKS
            ):
                return True  # every shard belongs to another live session
            self._sleep()
            return False
        if self.pause_s:
            pause, self.pause_s = self.pause_s, 0.0
            self.waits.wait(pause)
            return False
        source = relay.state.current
        empty_after = self._publish_run(source)
        self.failures = 0
        if self.later:
            self._retry_bad_rows()  # the backlog is gone: their turn, before any idle wait
            return False
        if empty_after is None:
            self.flag.looked_up()
            return False  # stopped, rebalance due or source switched: back to the top
        after = empty_after
        switching_from_flat = relay.state.mode is Mode.switching and source is relay.state.flat
        drained_proof_needed = options.until_empty or switching_from_flat
        if after > 0 and drained_proof_needed:
            # Empty above the frontier is not empty: prove it with a claim from id 0.
            self.cursor.force_full_rescan()
            return False
        if source is relay.state.flat and relay.state.try_switch(self.conn):
            return False
        if options.until_empty and relay._nothing_left(self.conn):
            return True
        keepalive.arm_idle_timeout(self.conn)
        self._idle(source)
        return False

    def _idle(self, source: queries.Source) -> None:
        """Nothing to claim: sleep until a notification or the poll interval — with the idle
        flag up, so the wake-up trigger notifies (relay/notify.py)."""
        if self.cursor.due():
            return  # a claim below the cursor is due (a late row may be visible): no sleep
        if self.flag.idle() is Idle.RAISE:
            if self._raise_idle_flag(source):
                return  # claim once more with the flag up, then sleep
            self._sleep(self.flag.not_raised())  # soon rather than at the poll interval
            return
        self._sleep()

    def _raise_idle_flag(self, source: queries.Source) -> bool:
        key = notify.idle_lock_key(source.label)
        row = self.conn.execute(queries.try_idle_lock(), {"key": key}).fetchone()
        if row and row[0]:
            self.flag.raised(key)
            # Every writer that saw the relay busy has committed (they held the lock shared):
            # the confirming claim must reach their rows below the cursor too (cursor.confirm).
            self.cursor.confirm()
            return True
        return False

    def _lower_idle_flag(self) -> None:
        """Queue the flag's release (pipeline): a claiming relay needs no notifications."""
        key = self.flag.lower()
        if key is not None:
            assert self.wire is not None
            self.wire.send(_IDLE_UNLOCK, {"key": key})

    # -- notifications: a LISTEN session per worker (relay/listener.py) --------------------

    def _listen(self) -> None:
        """Open the worker's LISTEN session (when notifications are on), after its claim
        session was (re)opened; idle waits (`_sleep`) poll its socket and the stop pipe."""
        self.listener.close()
        if self.flag.enabled:
            self.listener.open()

    def _sleep(self, timeout_s: float | None = None) -> bool:
        """Wait until a notification calls for a claim, a stop, or `timeout_s` (default: the
        poll interval). True: woken (or stopping), False: timed out. Returns at once when a
        notification read meanwhile calls for a claim."""
        relay = self.relay
        if relay.stopping:
            return True
        timeout = relay.options.poll_interval_s if timeout_s is None else timeout_s
        listener = self.listener
        relisten = not listener.listening and self.flag.enabled and self.conn is not None
        if relisten and self._relisten():
            return True
        if not listener.listening:
            self.blocked = True
            return self.waits.wait(timeout)
        woken = listener.poll(timeout)  # reads what libpq and the socket hold first
        self.blocked = listener.blocked
        return woken

    def _relisten(self) -> bool:
        """The LISTEN session was lost (`Listener.poll`): listen again. True when it worked:
        then claim once — a row committed while nobody listened notified no one."""
        from outbox_migrate.errors import ConnectError

        try:
            self._listen()
        except _connection_errors(ConnectError) as exc:
            log.debug("relay.listen_failed worker=%d %s", self.index, _one_line(exc))
            return False
        return True

    # -- the hot path: batches back to back, one round trip each ------------------------

    def _statements(self, source: queries.Source) -> tuple[bytes, bytes, bytes, bool]:
        """Claim and mark of `source`, rendered once per session and shard layout.

        A worker that owns every shard (the usual single worker) claims without the shard
        filter: nobody else can claim here, and `mod(id, n) = ANY(all)` only costs.
        """
        relay = self.relay
        sharded = self.lease.sharded and not self.lease.owns_all
        key = (source.label, sharded)
        rendered = self.rendered.get(key)
        if rendered is None:
            claim = queries.claim(
                source,
                relay._columns[source.label],
                sharded=sharded,
                by_key=relay.options.ordering is Ordering.key,
            )
            rendered = (
                claim.as_bytes(self.conn),
                queries.probe(source, relay._columns[source.label]).as_bytes(self.conn),
                queries.mark(source).as_bytes(self.conn),
            )
            self.rendered[key] = rendered
            assert self.wire is not None
            # Prepared before the pipeline starts (PQprepare is synchronous); the gap probe
            # and the horizon only where the cursor uses them (integer ids).
            used = [rendered[0], rendered[2], _IDLE_UNLOCK, _TRY_IDLE_LOCK]
            if not relay._text_ids:
                used += [rendered[1], _HORIZON]
            for statement in used:
                self.wire.prepare(statement)
        return rendered[0], rendered[1], rendered[2], sharded

    def _claim(
        self, claim: bytes, probe: bytes, sharded: bool, flag_rows: int = -1
    ) -> tuple[list[Any], int, int]:
        """Queue BEGIN and the claim, send everything queued, return the claimed rows, the
        `after` the range claim started from and how many rows that range claim returned.

        When the cursor's gap probe is due, the remembered gaps are claimed by id in the same
        transaction and round trip, ahead of the range claim (they are all below it).

        The idle flag (`flag_rows` >= 0, see `_publish_run`): after a claim that found nothing
        the flag goes up with this claim — `pg_try_advisory_lock` in the same network write,
        ahead of BEGIN — so that if this claim finds nothing (or a trickle), the worker may
        sleep at once: its snapshot is taken with the flag up, and every row it cannot see
        will notify. A raised flag stays up through claims of a trickle (SPARSE_ROWS) while
        the worker sleeps between them, and comes down in the same way (`pg_advisory_unlock`
        in the claim's write) after a bigger claim, or once the traffic no longer lets the
        worker sleep (AWAKE_WAITS).
        """
        relay, cursor, pipe = self.relay, self.cursor, self.wire
        assert pipe is not None
        self.listener.take()
        flag = self.flag
        unlock, try_raise = flag.before_claim(flag_rows)
        if unlock is not None:
            pipe.send(_IDLE_UNLOCK, {"key": unlock})
        raising = None
        if try_raise:
            # Writers that saw the relay busy hold the lock shared until they commit: once it
            # is ours, their rows are visible to this claim — below the cursor too (confirm).
            raising = pipe.send(_TRY_IDLE_LOCK, {"key": flag.run_key})
            cursor.confirm()
        now = time.monotonic()
        after = cursor.start(now)
        gaps = cursor.probe(now) if after >= cursor.frontier else None
        params: dict[str, Any] = {"after": after, "limit": relay.options.batch_size}
        if sharded:
            params.update(shards=self.lease.count, mine=self.lease.mine())
        started = time.monotonic()
        pipe.send_plain(b"BEGIN")
        late = pipe.send(probe, {"ids": gaps}) if gaps else None
        claimed = pipe.send(claim, params)
        # While ids below the cursor are unaccounted for, read the horizon after the claim.
        horizon = pipe.send(_HORIZON) if cursor.wants_horizon() else None
        # A Sync after the claim: the server only starts its idle-in-transaction timer after
        # a Sync, so without one a relay paused mid-batch would keep its session (and shards)
        # for good. It travels in the same network write as the claim.
        pipe.sync()
        if raising is not None:
            got = pipe.rows(raising)
            if got and got[0][0]:
                flag.raised(flag.run_key)
        rows: list[Any] = pipe.rows(claimed)
        self.fence.proven(started)
        ranged = len(rows)
        if late is not None:
            found = pipe.rows(late)
            if found:
                found.sort(key=_ID)
                rows = found + rows
        if after == 0:
            now = time.monotonic()
            cursor.rescanned(now - started, now)
        if horizon is not None:
            xmin, xmax = pipe.rows(horizon)[0]
            cursor.horizon(int(xmin), int(xmax), time.monotonic())
        flag.claimed(len(rows), flag_rows)
        return rows, after, ranged

    def _publish_run(self, source: queries.Source) -> int | None:  # noqa: PLR0912, PLR0915
        # One loop on purpose: the batch in hand moves between two sessions, and its mark and
        # COMMIT leave with whatever the loop sends next; split up, that state would be shared.
        """Claim → publish → mark, batch after batch, until a claim comes back empty (returns
        the `after` it started from) or the worker must look up (stop, rebalance, switch:
        returns None).

        One batch is still one transaction, but the session runs in pipeline mode (prepared
        statements sent through libpq directly: relay/wire.py) with explicit BEGIN/COMMIT, so
        a batch's mark and COMMIT travel with the next batch's BEGIN and claim:
        one round trip per batch instead of four (BEGIN, claim, mark, COMMIT). At batch 100
        the round trips were as costly as the SQL itself (bench/relay.py). A batch counts as
        published once its COMMIT is known to have succeeded: when a later result of its
        session arrives (results come back in order), or at the final sync. When the next
        claim fails (SQLSTATE 40001, a lost connection), the COMMIT before it already
        happened or not — its own result says which.

        Read-ahead (relay/read_ahead.py): while claims come back full, the next batch is
        claimed on the worker's other session before this one is published, so the server
        claims (and marks) while the relay publishes; batches alternate between the sessions.

        Linger: after a claim that did not fill a batch, the next claim waits until
        `linger_s` after the previous one was sent. Steady traffic then costs one batch and
        one wake-up of the relay per linger period instead of one per message. The batch's
        mark and COMMIT are sent before the wait, their results read with the next claim's
        (one wait for the server per batch, as without a linger). They used to wait with the
        batch for the next claim, saving a network write and a wake-up of the server backend
        per batch, but the session then sat "idle in transaction" on its row locks through
        nearly every linger under steady traffic — and the migration runner does not queue a
        step's lock behind such a session, so a step could not find a moment to take it
        (tests/integration/relay/test_wake_up.py).
        """
        relay, cursor, pipe = self.relay, self.cursor, self.wire
        assert self.sink is not None and pipe is not None  # built by _step before any claim
        claim, probe, mark, sharded = self._statements(source)
        batch_size, linger = relay.options.batch_size, self._linger_s(source)
        ahead_ok = self._read_ahead_allowed(source)
        flag_rows = self._flag_rows(source, linger)
        self.flag.run_key = notify.idle_lock_key(source.label)
        # Batches whose COMMIT was queued and not yet seen to succeed (at most one per session).
        pending: list[Commit] = []
        empty_after: int | None = None
        try:
            with pipe.pipeline():
                started = time.perf_counter()
                sent = time.monotonic()
                rows, after, ranged = self._claim(claim, probe, sharded, flag_rows)
                conn, cur = self.conn, pipe  # the session holding the batch in hand
                while True:
                    if pending:
                        self._count_committed(pending)
                    if not rows:
                        cur.send_plain(b"ROLLBACK")
                        if flag_rows < 0:
                            empty_after = after
                            break
                        if cur is not pipe:  # the read-ahead claim came back empty
                            cur.sync()
                            conn, cur = self.conn, pipe
                        if self._wait_in_run(pipe, source, pending):
                            break
                        started = time.perf_counter()
                        sent = time.monotonic()
                        rows, after, ranged = self._claim(claim, probe, sharded, flag_rows)
                        continue
                    if len(rows) > flag_rows:
                        # The claim after raising the flag found rows, or more than a sparse
                        # trickle: writers need not notify while the worker claims.
                        self._lower_idle_flag()
                    ahead = None
                    if (
                        ahead_ok
                        and ranged == batch_size
                        and self._may_read_ahead(source, time.monotonic())
                    ):
                        # From the last id in hand: the rows come in ascending id order.
                        ahead = self._send_ahead(
                            cur, claim, mark, sharded, max(cursor.frontier, rows[-1][0])
                        )
                    pause, now = self._publish_batch(
                        conn, cur, Batch(source, mark, rows, after, started), pending
                    )
                    stop_run = (
                        relay.stopping or self.lease.due(now) or relay.state.current is not source
                    )
                    if ahead is not None and self._take_ahead(
                        ahead, cur, keep=not (pause or stop_run or self.rewound)
                    ):
                        started = time.perf_counter()
                        rows, after, ranged = self._receive_ahead(ahead)
                        conn, cur = ahead.conn, ahead.pipe
                        continue
                    if pause:  # a rejection's backoff, or a claim of parked keys only
                        self.pause_s = pause  # taken in `_step`, after the COMMIT
                        break
                    if stop_run:
                        break
                    if cur is not pipe:
                        # The batch is the read-ahead session's: its mark and COMMIT complete
                        # before the lease session claims again (a claim from id 0 must not
                        # meet rows that move under it).
                        cur.sync()
                        conn, cur = self.conn, pipe
                    if (
                        self.flag.held
                        and ranged < batch_size
                        and self._wait_in_run(pipe, source, pending)
                    ):
                        break  # a sparse row published with the flag up: slept until woken
                    if ranged < batch_size and linger > 0 and self._linger(pending, sent + linger):
                        break
                    started = time.perf_counter()
                    sent = time.monotonic()
                    rows, after, ranged = self._claim(claim, probe, sharded, flag_rows)
            self.read_ahead.settle()
        except BaseException:
            self._abort_run(pending)
            raise
        self._count_committed(pending)
        return empty_after

    def _flag_rows(self, source: queries.Source, linger: float) -> int:
        """How many rows a claim made with the idle flag up may return for the flag to stay
        up, the worker then sleeping inside the run (`_wait_in_run`); -1: the flag is only
        raised after the run, by `_idle`.

        Only where an empty claim means "sleep until notified": with notifications, and not
        while the switching relay drains the flat table (its empty claim starts the switch)."""
        state = self.relay.state
        if not self.flag.enabled or (state.mode is Mode.switching and source is state.flat):
            return -1
        return SPARSE_ROWS

    def _wait_in_run(self, pipe: wire.Wire, source: queries.Source, pending: list[Commit]) -> bool:
        """Nothing more to claim now: wait — until a notification or the poll interval with
        the idle flag up, shortly without it — staying in the run (no pipeline exit, no
        statements of its own), the last COMMIT or ROLLBACK queued for the next claim to take
        along (`_hold`). True: the worker must go back to `_step` first (stop, lease check,
        source switch).

        The flag was up while the last claim's snapshot was taken, or this waits briefly
        (`IdleFlag.busy_poll_s`) and the next claim raises it: an idle worker costs one round trip
        per wake-up, where leaving the run, raising the flag on its own and confirming cost
        six.
        """
        # CLAIM: a claim below the cursor is due (a late row may be visible), or the last
        # claim did not try to raise the flag: claim again now (what is queued goes with it).
        action = self.flag.in_run(self.cursor.due())
        if action is Idle.SLEEP:
            linger = self._linger_s(source)
            woken = self._hold(pipe, pending, None)
            self.flag.slept(blocked=self.blocked)
            if woken and linger > 0:
                # Woken by a row's notification: give it `linger` for company, as a batch
                # that did not fill waits before the next claim — a trickle then costs one
                # claim per linger period, not one per row.
                self._linger([], time.monotonic() + linger)
        elif action is Idle.BUSY_POLL:
            # A writer that saw the relay busy has not committed yet (it holds the flag's lock
            # shared and will not notify), or another worker holds the flag: look again soon.
            self._hold(pipe, pending, self.flag.busy_poll_s())
        relay = self.relay
        relay.observer.heartbeat(self.index)
        return (
            relay.stopping
            or bool(self.pause_s)
            or self.lease.due(time.monotonic())
            or relay.state.current is not source
        )

    def _hold(self, pipe: wire.Wire, pending: list[Commit], timeout_s: float | None) -> bool:
        """Sleep (`_sleep`) once the last batch's mark and COMMIT (or the empty claim's
        ROLLBACK) went out, without waiting for their results: the next claim reads them with
        its own, so a wake-up costs one wait for the server, not two. Not sent with that
        claim instead (it would save a write): the session would sleep inside its transaction,
        holding its lock on the outbox — under steady traffic nearly all the time, which kept
        a migration step's DDL from ever finding a moment to take its lock (the demo's COPRA
        run under load: "blocked by relay-0, idle in transaction"). Results not read within
        HOLD_S are read then (the batch is counted).
        True: woken (a notification, or a stop) before the timeout."""
        relay = self.relay
        pipe.send_sync()
        if pending:
            pending[-1].sent = time.perf_counter()
        timeout = relay.options.poll_interval_s if timeout_s is None else timeout_s
        if timeout <= HOLD_S:
            return self._sleep(timeout)
        if self._sleep(HOLD_S):
            return True
        pipe.sync()
        self._count_committed(pending)
        woken = self._sleep(timeout - HOLD_S)
        self.blocked = True  # it slept HOLD_S already
        return woken

    def _abort_run(self, pending: list[Commit]) -> None:
        """A run failed: roll back both sessions, count what did commit (a COMMIT of the
        read-ahead session still in flight is read first, so a batch marked is counted), and
        keep the published batches whose mark did not commit for `_repair_marks`."""
        self.read_ahead.abandon()
        for commit in pending:
            if commit.succeeded:
                self._count(commit)
        self.unmarked = [c for c in pending if not c.succeeded]
        self._end_transaction()

    def _receive_ahead(self, ahead: read_ahead.Pending) -> tuple[list[Any], int, int]:
        """The rows claimed ahead, as `_claim` returns them (rows, after, rows of the range
        claim); a claim on the lease session proves the lease too."""
        rows = self.read_ahead.receive(ahead)
        if ahead.pipe is self.wire:
            self.fence.proven(ahead.sent)
        self.flag.claimed_ahead(len(rows))
        self.relay.stats.add(read_ahead=1)
        return rows, ahead.after, len(rows)

    def _publish_batch(
        self,
        conn: Any,
        pipe: wire.Wire,
        claim: Batch,
        pending: list[Commit],
    ) -> tuple[float, float]:
        """Publish the claimed rows and queue their mark and COMMIT on their session. Returns
        the pause the worker takes once the transaction has ended (0: none; see
        `Relay._publish`) and the time after."""
        relay, cursor = self.relay, self.cursor
        source, rows, after = claim.source, claim.rows, claim.after
        batch, bad = claimed.messages(rows, relay._message, relay._columns[source.label])
        claim.messages, claim.bad = batch, bad
        self.fence.check(time.monotonic())
        assert self.sink is not None
        acked, claim.dead, retry, pause, rewind = relay._publish(
            wire.direct(conn, pipe), self.sink, source, batch, bad, after
        )
        if relay._suspects and acked:
            acked, again = self._mark_suspects(conn, pipe, source, rows, batch, acked)
            retry += again
        claim.acked, claim.retry, claim.pause, claim.rewind = acked, retry, pause, rewind
        if relay._abandon.is_set():
            raise _Abandoned
        now = time.monotonic()
        cursor.claimed(after, [r[0] for r in rows], now)
        # After a rejection's pause, or for a released key: claim again from `rewind` (the
        # read-ahead batch, if any, is dropped). Bad rows: by id, once the backlog is drained.
        self.rewound = rewind is not None
        if rewind is not None:
            cursor.retry_from(rewind)
        elif retry:
            self.later += retry
            if len(rows) < relay.options.batch_size:
                self._retry_bad_rows()
        pending.append(mark_and_commit(pipe, claim))
        relay.observer.heartbeat(self.index)
        return pause, now

    def _retry_bad_rows(self) -> None:
        """Bad rows to try again are claimed by id with the next claim on the lease session
        (`Cursor.retry_ids`) — once claims no longer come back full: a claim with a probe is
        not read ahead, and trying each bad row again in the very next batch cost a fifth of
        the drain rate at one bad row per 10,000 (bench/bad_rows.py)."""
        self.cursor.retry_ids(self.later, time.monotonic())
        self.later = []

    def _mark_suspects(
        self,
        conn: Any,
        pipe: wire.Wire,
        source: queries.Source,
        rows: list[Any],
        batch: list[Message],
        acked: list[MessageId],
    ) -> tuple[list[MessageId], list[MessageId]]:
        """Rows whose mark failed before are marked alone first (mark_repair.py); returns the
        acknowledged ids left for the batch's mark and the ids to claim again."""
        relay = self.relay
        done = mark_repair.mark_suspects(
            wire.direct(conn, pipe), source, relay.failures, relay._suspects, rows, batch, acked
        )
        relay._count_failures(0, len(done.bad), dead=len(done.dead))
        held = mark_repair.park(relay._parking, source.label, batch, done, relay._backoff,
                                by_key=relay.options.ordering is Ordering.key)  # fmt: skip
        return [i for i in acked if i not in done.bad and i not in held], done.retry

    @staticmethod
    def _take_ahead(ahead: read_ahead.Pending, cur: wire.Wire, *, keep: bool) -> bool:
        """After a batch was published: send its mark and COMMIT and take the batch claimed
        ahead (True), or — the publish was refused in part, or the worker must look up — roll
        the read-ahead back unpublished (its rows are claimed again later)."""
        if keep:
            cur.send_sync()
            return True
        ahead.pipe.send_plain(b"ROLLBACK")
        ahead.pipe.send_sync()
        return False

    def _read_ahead_allowed(self, source: queries.Source) -> bool:
        """Read-ahead keeps publishing one batch at a time in id order, but a rejection would
        meet a batch already claimed behind it: with key or global ordering (parking, strict
        order) and application ids (no cursor to claim after) it is not used."""
        relay = self.relay
        options = relay.options
        return (
            options.read_ahead
            and options.ordering is Ordering.none
            and not relay._text_ids
            # Not while the switching relay drains the flat table to leave it: that run must
            # end with a claim that comes back empty, and it is short.
            and not (relay.state.mode is Mode.switching and source is relay.state.flat)
        )

    def _may_read_ahead(self, source: queries.Source, now: float) -> bool:
        """Whether the next claim may be a plain range claim from the frontier, claimed now on
        the other session: nothing the lease session must do first (relay/read_ahead.py)."""
        relay = self.relay
        return not (
            relay.stopping
            or self.pause_s
            or self.lease.due(now)
            or relay.state.current is not source
            or self.listener.take()
            or not self.cursor.plain(now)
        )

    def _send_ahead(
        self, cur: wire.Wire, claim: bytes, mark: bytes, sharded: bool, after: int
    ) -> read_ahead.Pending:
        """Send the next batch's claim, from `after`, on the session not holding `cur`."""
        params: dict[str, Any] = {"limit": self.relay.options.batch_size}
        if sharded:
            params.update(shards=self.lease.count, mine=self.lease.mine())
        if cur is not self.wire:
            assert self.wire is not None
            return self.read_ahead.send(self.wire, self.conn, claim, params, after)
        conn, pipe = self.read_ahead.session((claim, mark))
        self.relay._conns[_ahead_key(self.index)] = conn
        return self.read_ahead.send(pipe, conn, claim, params, after)

    def _linger_s(self, source: queries.Source) -> float:
        relay = self.relay
        if relay.state.mode is Mode.switching and source is relay.state.flat:
            # The flat table is drained to be left: the switch needs an empty claim, and a
            # linger would let steady V1 traffic fill every claim so none ever comes back empty.
            return 0.0
        return relay.options.linger_s

    def _linger(self, pending: list[Commit], until: float) -> bool:
        """Send the batch's mark and COMMIT, then wait until `until` (or a stop: True); their
        results are read with the next claim's, or at the pipeline's final sync on a stop (the
        batch is counted then, as after a batch without linger; its time excludes the wait)."""
        # The mark and COMMIT leave now (a no-op when `_hold` sent them): lingering inside the
        # transaction would hold its row locks and show the session "idle in transaction"
        # through every linger, which the migration runner will not queue behind.
        assert self.wire is not None
        self.wire.send_sync()
        if pending:
            pending[-1].sent = time.perf_counter()
        self.waits.sleep(until - time.monotonic())  # a plain sleep when short (waits.py)
        return self.relay.stopping

    def _count_committed(self, pending: list[Commit]) -> None:
        """Count the batches whose COMMIT result came back (a failed one raised already)."""
        done = [c for c in pending if c.commit.result is not None]
        for commit in done:
            self._count(commit)
            pending.remove(commit)

    def _count(self, commit: Commit) -> None:
        relay = self.relay
        relay.stats.batch(commit.published)
        relay.observer.published(commit.published)
        relay.observer.batch_seconds((commit.sent or time.perf_counter()) - commit.started)

    def _end_transaction(self) -> None:
        """After a failed run: roll back whatever transaction the session is still in."""
        import psycopg

        conn = self.conn
        if conn is None or conn.closed:
            return
        try:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                conn.execute(b"ROLLBACK")
        except Exception:  # a broken session: the caller's error handling replaces it
            log.debug("relay.rollback_failed", exc_info=True)


def _ahead_key(index: int) -> int:
    """The read-ahead session's key in `Relay._conns` (cancelled at the shutdown timeout)."""
    return -1 - index


_HORIZON = queries.horizon().as_string().encode()
_IDLE_UNLOCK = queries.idle_unlock().as_string().encode()
_TRY_IDLE_LOCK = queries.try_idle_lock().as_string().encode()
_ID = operator.itemgetter(0)
_BY_ID = operator.attrgetter("id")
"""Claim order with key ordering: by id (application ids are then claimed by id too)."""


@contextmanager
def running(relay: Relay) -> Iterator[threading.Thread]:
    """Run a relay in a background thread for the duration of a `with` block (tests, sim)."""
    thread = threading.Thread(target=relay.run, name="relay", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        relay.stop()
        thread.join(timeout=relay.options.shutdown_timeout_s + ABANDON_GRACE_S + 5)
