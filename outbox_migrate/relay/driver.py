"""One polling relay worker: a thread with its own sessions, sink, shards and cursor, which
sorts its failures (docs/relay.md, "Failures"). It sees its relay only through `Shared`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from psycopg.errors import IntegrityError, SerializationFailure

from outbox_migrate.backoff import jitter_s
from outbox_migrate.db import one_line
from outbox_migrate.errors import MarkFellShort, RelayFailed, SinkCrashed, SinkUnavailable
from outbox_migrate.patterns import notify
from outbox_migrate.relay import keepalive, queries, wire
from outbox_migrate.relay.batch import Phase, WorkerState
from outbox_migrate.relay.batch_loop import Abandoned, BatchLoop, ahead_key
from outbox_migrate.relay.cursor import Cursor, NoCursor
from outbox_migrate.relay.idle_flag import Idle, IdleFlag
from outbox_migrate.relay.keepalive import Fence, LeaseUnproven, back_off_keeping_session
from outbox_migrate.relay.marker_source import check_names
from outbox_migrate.relay.options import Mode, Ordering
from outbox_migrate.relay.run_stats import count_failures
from outbox_migrate.relay.shards import UNTIL_EMPTY_PATIENCE_CHECKS, ShardLease, home_shards
from outbox_migrate.relay.shared import Shared, close_sink, connection_errors
from outbox_migrate.relay.sinks import Sink
from outbox_migrate.relay.waits import Listener, Session, Waits

log = logging.getLogger("outbox_migrate.relay")

REAP_MARGIN_S = 0.5
"""Past the server's own idle-session bound before survivors end a silent shard holder."""


class Worker:
    def __init__(self, relay: Shared, index: int) -> None:
        options = relay.options
        table = relay.state.flat if options.mode is Mode.flat else relay.state.partitioned
        self.relay = relay
        self.index = index
        self.lease = ShardLease(
            key=f"{notify.ADVISORY_NAMESPACE}:{table.label}",
            shards=options.shard_count,
            home=home_shards(index, options.workers, options.shard_count),
            reap_after_s=(
                options.dead_session_s + options.poll_interval_s + REAP_MARGIN_S
                if options.dead_session_s > 0
                else None
            ),
        )
        self.conn: Any = None
        self.wire: wire.Wire | None = None
        self.sink: Sink | None = None
        self.state = WorkerState()
        self.fence = Fence(options.dead_session_s, options.sink_timeout_s)
        self.cursor: Cursor = (
            NoCursor(now=time.monotonic())
            if relay.text_ids
            else Cursor(
                shards=options.shard_count,
                mine=[],
                track_gaps=options.ordering is not Ordering.key,
                now=time.monotonic(),
            )
        )
        self.flag = IdleFlag(options.listen and not options.until_empty, options.linger_s)
        # Every wait of this worker goes through it: none with a session in a transaction.
        self.waits = Waits(relay.stopped, self._sessions)
        self.listener = Listener(relay.connect_worker, options.channel,
                                 relay.wake_fd, self.waits, self.cursor.notified_payloads,
                                 index)  # fmt: skip
        self.loop = BatchLoop(relay, index, lease=self.lease, cursor=self.cursor,
                              flag=self.flag, fence=self.fence, listener=self.listener,
                              waits=self.waits, sleep=self._sleep,
                              state=self.state)  # fmt: skip

    def _sessions(self) -> tuple[Session, Session]:
        ahead = self.loop.read_ahead
        return (self.conn, self.wire), (ahead.conn, ahead.pipe)

    def run(self) -> None:
        relay = self.relay
        try:
            while not relay.stopping:
                relay.observer.heartbeat(self.index)
                if self._step_guarded():
                    return
        except Abandoned:
            self.state.to(Phase.STOPPING)
            log.warning("relay.batch_abandoned worker=%d", self.index)
        except Exception as exc:
            # Not retryable: stop the whole relay and report it, rather than die silently.
            if isinstance(exc, SinkCrashed):
                self._count_crash(exc)
            log.error("relay.worker_failed worker=%d %s", self.index, exc,
                      exc_info=log.isEnabledFor(logging.DEBUG))  # fmt: skip
            relay.fail(exc)
        finally:
            self.state.to(Phase.STOPPING)
            relay.observer.worker_done(self.index)
            close_sink(self.sink)
            if self.conn is not None and not self.conn.closed:
                try:
                    self.lease.release_all(self.conn)
                except Exception:  # the session is closing anyway
                    log.debug("relay.release_failed", exc_info=True)
            relay.close_conn(self.index, self.conn)
            self.listener.close()
            relay.conns.pop(ahead_key(self.index), None)
            self.loop.read_ahead.close()

    def _count_crash(self, crashed: SinkCrashed) -> None:
        import psycopg

        conn = self.conn
        if conn is None or conn.closed:
            return
        try:
            with conn.transaction():
                reasons = dict.fromkeys(crashed.ids, crashed.reason)
                self.relay.refusals.failures.count(conn, crashed.label, reasons)
        except (psycopg.Error, RelayFailed) as failed:
            log.warning(
                "relay.attempts_not_counted worker=%d %s", self.index, one_line(str(failed))
            )

    def _step_guarded(self) -> bool:
        """One loop iteration with its failures sorted. True: this worker is done."""
        from outbox_migrate.errors import ConnectError

        relay = self.relay
        try:
            if self.state.must_repair():
                self._repair_marks()
            return self._step()
        except MarkFellShort as exc:
            # Its rows are claimed and sent again, unless the names moved (`NamesMoved`).
            self._look_at_names()
            log.warning("relay.mark_fell_short worker=%d %s", self.index, exc)
        except LeaseUnproven as exc:
            relay.observer.failed("fenced")
            log.warning("relay.fenced worker=%d %s", self.index, exc)
        except SinkUnavailable as exc:
            count_failures(relay.stats, relay.observer, sink=1)
            log.warning("relay.sink_unavailable worker=%d %s", self.index, exc)
            close_sink(self.sink)
            self.sink = None
            self._step_out()
            self._back_off(keep_session=True)
        except IntegrityError as exc:
            # A mark broke a constraint: the next step finds the rows at fault.
            if not self.state.unmarked:
                raise  # no batch to repair: not a mark's failure
            self.state.mark_failure = exc
        except SerializationFailure:
            # Another claimer moved a row we were about to lock (queries.py). Before
            # connection errors: SerializationFailure is an OperationalError too.
            relay.stats.add(serialization_retries=1)
            relay.observer.failed("serialization")
            self.state.to(Phase.BACKING_OFF)
            self.waits.wait(jitter_s())
        except connection_errors(ConnectError) as exc:
            relay.stats.add(connection_retries=1)
            relay.observer.failed("connection")
            log.warning("relay.connection_lost worker=%d %s", self.index, one_line(str(exc)))
            self._forget_session()
            self._back_off()
        return False

    def _repair_marks(self) -> None:
        """A step of its own, so its failures are sorted as anywhere else (no session: the
        rows are sent again)."""
        state = self.state
        exc, state.mark_failure = state.mark_failure, None
        if self.conn is None or self.conn.closed:
            state.unmarked = []
            return
        self.loop.repair(self.conn, exc)

    def _step_out(self) -> None:
        if self.conn is None or self.conn.closed:
            return
        try:
            self.lease.step_out(self.conn)
        except connection_errors():  # the session is gone: so are its locks
            log.debug("relay.step_out_failed", exc_info=True)

    def _forget_session(self) -> None:
        self.relay.close_conn(self.index, self.conn)
        self.listener.close()
        self.conn = None
        self.lease.lost()
        self.state.to(Phase.CONNECTING)

    def _back_off(self, *, keep_session: bool = False) -> None:
        """`keep_session` (the broker is away, PostgreSQL is not): keep the session alive
        through the wait, or drop it if it died, so the wake-up tries the broker first."""
        delay = self.relay.options.backoff(self.state.back_off())
        conn = self.conn
        if keep_session and conn is not None:
            if conn.closed:
                self.waits.wait(delay)
            elif back_off_keeping_session(self.waits.wait, delay, conn):
                return
            log.info("relay.session_reopened worker=%d (ended before the wake-up)", self.index)
            self._forget_session()
            return
        self.waits.wait(delay)

    def _step(self) -> bool:
        """Open what is missing, keep the shard lease, then one run of batches. True: done."""
        relay, options, lease = self.relay, self.relay.options, self.lease
        if self.conn is None:
            self._open_session()
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
        state = self.state
        if state.pause_s:
            self.waits.wait(state.unpark())
            return False
        source = relay.state.current
        state.to(Phase.CLAIMING)
        empty_after = self.loop.run(source, self.sink)
        state.served()
        return self._after_run(source, empty_after)

    def _after_run(self, source: queries.Source, empty_after: int | None) -> bool:
        """Retry bad rows, look up, prove the source drained, switch, or go idle. True: done."""
        relay, options, state = self.relay, self.relay.options, self.state
        if state.later or state.unmarked:
            # Bad rows and failed marks go before any idle wait.
            self.loop.retry_bad_rows()
            return False
        if empty_after is None:
            self.flag.looked_up()
            return False  # stopped, rebalance due or source switched: back to the top
        switching_from_flat = relay.state.mode is Mode.switching and source is relay.state.flat
        if empty_after > 0 and (options.until_empty or switching_from_flat):
            # Empty above the frontier is not empty: prove it with a claim from id 0.
            self.cursor.force_full_rescan()
            return False
        if switching_from_flat:
            state.to(Phase.SWITCHING)
        if source is relay.state.flat and relay.state.try_switch(self.conn):
            return False
        if options.until_empty and relay.nothing_left(self.conn):
            return True
        keepalive.arm_idle_timeout(self.conn)
        self._idle(source)
        return False

    def _open_session(self) -> None:
        relay, options, lease = self.relay, self.relay.options, self.lease
        timeout_s = options.dead_session_s
        self.conn = relay.connect_worker()
        keepalive.configure_session(self.conn, timeout_s, options.poll_interval_s)
        self.fence.lost()
        # The planner underestimates `mod(id, n) = ANY(mine)` and would scan and sort rather
        # than walk the id index; every statement here wants index order.
        self.conn.execute(queries.claim_session_settings())
        # The hot path prepares its own statements (relay/wire.py): psycopg's would send
        # DEALLOCATE ALL on a ROLLBACK, taking ours too.
        self.conn.prepare_threshold = None
        self.wire = wire.Wire(self.conn)
        self.loop.new_session(self.conn, self.wire)
        self._listen()
        relay.conns[self.index] = self.conn
        lease.lost()
        self.flag.session_lost()

    def _look_at_names(self) -> None:
        """A mark fell short: stop the relay (`NamesMoved`) if the source's names moved."""
        if self.conn is None or self.conn.closed:
            return
        try:
            check_names(self.conn, self.relay.state.current)
        except connection_errors() as exc:  # the main thread's look covers it
            log.debug("relay.names_unchecked worker=%d %s", self.index, one_line(str(exc)))

    def _idle(self, source: queries.Source) -> None:
        if self.cursor.due(time.monotonic()):
            return  # a claim below the cursor is due (a late row may be visible): no sleep
        self.state.to(Phase.IDLE)
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
            # Writers that saw the relay busy have committed: reach their rows (cursor.confirm).
            self.cursor.confirm()
            return True
        return False

    # -- notifications: a LISTEN session per worker (relay/waits.py) -----------------------

    def _listen(self) -> None:
        self.listener.close()
        if self.flag.enabled:
            self.listener.open()

    def _sleep(self, timeout_s: float | None = None) -> bool:
        """Wait for a notification calling for a claim, a stop, or `timeout_s`. True: woken."""
        relay = self.relay
        if relay.stopping:
            return True
        timeout = relay.options.poll_interval_s if timeout_s is None else timeout_s
        scheduled = self.cursor.wait_s(time.monotonic())
        if scheduled is not None:  # a parked key's message is due then (`Cursor.retry_at`)
            timeout = min(timeout, scheduled)
        listener = self.listener
        relisten = not listener.listening and self.flag.enabled and self.conn is not None
        if relisten and self._relisten():
            return True
        if not listener.listening:
            self.state.blocked = True
            return self.waits.wait(timeout)
        woken = listener.poll(timeout)  # reads what libpq and the socket hold first
        self.state.blocked = listener.blocked
        return woken

    def _relisten(self) -> bool:
        """Listen again. True when it worked: claim once, as a row committed while nobody
        listened notified no one."""
        from outbox_migrate.errors import ConnectError

        try:
            self._listen()
        except connection_errors(ConnectError) as exc:
            log.debug("relay.listen_failed worker=%d %s", self.index, one_line(str(exc)))
            return False
        return True
