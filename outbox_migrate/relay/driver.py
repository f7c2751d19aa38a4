"""One polling relay worker: claim → publish → mark, batch after batch, with its failures sorted.

Each worker is a thread with its own claim session (and a read-ahead session, and a LISTEN
session), its own sink, shards and id cursor; it sees its relay only through `Shared`
(relay/shared.py). One batch is one transaction (relay/batch.py); nothing is marked before the
broker acknowledged it. Its parts, each with its own state: the idle flag (relay/idle_flag.py,
a pure state machine), the LISTEN session (relay/listener.py), every wait (relay/waits.py:
never inside a transaction), the rejection policy (relay/refusals.py, shared). Failures:

* SQLSTATE 40001 (row moved to another partition by a concurrent mark): retried at once
  after a short jitter — the shard scheme makes it rare, the retry makes it harmless;
* a lost connection: reconnect with exponential backoff (shards are re-acquired);
* the sink unavailable: the batch rolls back, the worker backs off and retries, forever;
* messages the sink rejects: attempts are counted; after `max_attempts` the row goes to the
  dead-letter table and is marked in the same transaction (nothing lost).
"""

from __future__ import annotations

import logging
import operator
import time
from typing import Any

from psycopg.errors import IntegrityError

from outbox_migrate.relay import (
    claimed,
    keepalive,
    mark_repair,
    notify,
    queries,
    read_ahead,
    wire,
)
from outbox_migrate.relay.backoff import jitter_s
from outbox_migrate.relay.batch import Batch, Commit, mark_and_commit
from outbox_migrate.relay.cursor import Cursor, NoCursor
from outbox_migrate.relay.errors import RelayFailed, SinkUnavailable
from outbox_migrate.relay.fencing import Fence, LeaseUnproven
from outbox_migrate.relay.idle_flag import SPARSE_ROWS, Idle, IdleFlag
from outbox_migrate.relay.listener import Listener
from outbox_migrate.relay.message import Message, MessageId
from outbox_migrate.relay.options import Mode, Ordering
from outbox_migrate.relay.outage_wait import back_off_keeping_session
from outbox_migrate.relay.shards import UNTIL_EMPTY_PATIENCE_CHECKS, ShardLease, home_shards
from outbox_migrate.relay.shared import (
    Shared,
    close_sink,
    connection_errors,
    one_line,
    serialization_errors,
)
from outbox_migrate.relay.sinks import Sink
from outbox_migrate.relay.waits import Session, Waits

log = logging.getLogger("outbox_migrate.relay")

HOLD_S = 0.05
"""How long an idle worker leaves its last COMMIT's result unread for the next claim to read
with its own; then it reads it (see `Worker._hold`)."""
REAP_MARGIN_S = 0.5
"""Past the server's own idle-session bound (session timeout + poll interval) before the
survivors end a silent shard holder themselves (`ShardLease.reap`)."""


class Abandoned(Exception):
    """Raised inside a worker's transaction after the shutdown timeout: roll back, exit."""


class Worker:
    """One worker thread's state: its session, sink, shards and id cursor."""

    def __init__(self, relay: Shared, index: int) -> None:
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
            if relay.text_ids
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
                relay.connect_worker, options.dead_session_s, options.poll_interval_s
            )
        )
        """The worker's second session, claiming the next batch while one is published."""
        # Every wait of this worker goes through it: none with a session in a transaction.
        self.waits = Waits(relay.stopped, self._sessions)
        self.listener = Listener(relay.connect_worker, options.channel,
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
        except Abandoned:
            log.warning("relay.batch_abandoned worker=%d", self.index)
        except Exception as exc:
            # Not a failure the loop knows how to retry (a sink that cannot be built, a bug):
            # stop the whole relay and let run() report it, rather than die silently.
            log.error("relay.worker_failed worker=%d %s", self.index, exc,
                      exc_info=log.isEnabledFor(logging.DEBUG))  # fmt: skip
            relay.fail(exc)
        finally:
            relay.observer.worker_done(self.index)
            close_sink(self.sink)
            if self.conn is not None and not self.conn.closed:
                try:
                    self.lease.release_all(self.conn)
                except Exception:  # the session is closing anyway
                    log.debug("relay.release_failed", exc_info=True)
            relay.close_conn(self.index, self.conn)
            self.listener.close()
            relay.conns.pop(_ahead_key(self.index), None)
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
            close_sink(self.sink)
            self.sink = None
            self._step_out()
            self._back_off(keep_session=True)
        except IntegrityError as exc:
            # The mark of a published batch broke a constraint (a duplicate id moving into
            # the published partition): the next step finds the rows at fault, marks the rest.
            if not self.unmarked:
                raise  # no batch to repair: not a mark's failure
            self.mark_failure = exc
        except serialization_errors():
            # Another claimer moved a row we were about to lock (see queries.py). Checked
            # before connection errors: SerializationFailure is an OperationalError too, but
            # the session is fine.
            relay.stats.add(serialization_retries=1)
            relay.observer.failed("serialization")
            self.waits.wait(jitter_s())
        except connection_errors(ConnectError) as exc:
            relay.stats.add(connection_retries=1)
            relay.observer.failed("connection")
            log.warning("relay.connection_lost worker=%d %s", self.index, one_line(exc))
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
        refusals = relay.refusals
        assert exc is not None
        if self.conn is None or self.conn.closed:
            self.unmarked, self.mark_failure = [], None
            return
        while self.unmarked:
            claim = self.unmarked[0].batch
            source, rows, batch, acked = claim.source, claim.rows, claim.messages, claim.acked
            by_key = relay.options.ordering is Ordering.key
            try:
                done = mark_repair.repair(self.conn, source, refusals.failures,
                                          refusals.suspects, rows, batch, acked, exc,
                                          by_key=by_key)  # fmt: skip
            except IntegrityError as failed:  # the repair itself broke one: no loop of repairs
                raise RelayFailed(f"repairing a failed mark: {one_line(failed)}") from failed
            self.unmarked.pop(0)
            mark_repair.park(relay.refusals.parking, source.label, batch, done, relay.backoff,
                             by_key=by_key)  # fmt: skip
            relay.stats.batch(done.marked)
            relay.refusals.count_failures(0, len(done.bad), dead=len(done.dead))
            relay.observer.published(done.marked)
            self.later += done.retry
            log.warning(
                "relay.mark_repaired worker=%d marked=%d bad_rows=%d dead_lettered=%d %s",
                self.index, done.marked, len(done.bad), len(done.dead), one_line(exc),
            )  # fmt: skip
        self.mark_failure = None

    def _step_out(self) -> None:
        """The broker is out of reach: let the other relays serve this worker's shards while
        it backs off (it rejoins at its next lease check)."""
        if self.conn is None or self.conn.closed:
            return
        try:
            self.lease.step_out(self.conn)
        except connection_errors():  # the session is gone: so are its locks
            log.debug("relay.step_out_failed", exc_info=True)

    def _forget_session(self) -> None:
        """Drop a lost session (its shard locks died with it): `_step` opens a new one."""
        self.relay.close_conn(self.index, self.conn)
        self.listener.close()
        self.conn = None
        self.lease.lost()

    def _back_off(self, *, keep_session: bool = False) -> None:
        """`keep_session` (the broker is away, PostgreSQL is not): the session is kept alive
        through the wait, or dropped before the wake-up when it was lost anyway, so that the
        wake-up tries the broker instead of failing on a dead session (relay/outage_wait.py)."""
        delay = self.relay.backoff(self.failures)
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
            self.conn = relay.connect_worker()
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
            relay.conns[self.index] = self.conn
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
        if options.until_empty and relay.nothing_left(self.conn):
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
        except connection_errors(ConnectError) as exc:
            log.debug("relay.listen_failed worker=%d %s", self.index, one_line(exc))
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
                relay.columns[source.label],
                sharded=sharded,
                by_key=relay.options.ordering is Ordering.key,
            )
            rendered = (
                claim.as_bytes(self.conn),
                queries.probe(source, relay.columns[source.label]).as_bytes(self.conn),
                queries.mark(source).as_bytes(self.conn),
            )
            self.rendered[key] = rendered
            assert self.wire is not None
            # Prepared before the pipeline starts (PQprepare is synchronous); the gap probe
            # and the horizon only where the cursor uses them (integer ids).
            used = [rendered[0], rendered[2], _IDLE_UNLOCK, _TRY_IDLE_LOCK]
            if not relay.text_ids:
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
        `Refusals.publish`) and the time after."""
        relay, cursor = self.relay, self.cursor
        source, rows, after = claim.source, claim.rows, claim.after
        batch, bad = claimed.messages(rows, relay.message, relay.columns[source.label])
        claim.messages, claim.bad = batch, bad
        self.fence.check(time.monotonic())
        assert self.sink is not None
        acked, claim.dead, retry, pause, rewind = relay.refusals.publish(
            wire.direct(conn, pipe), self.sink, source, batch, bad, after
        )
        if relay.refusals.suspects and acked:
            acked, again = self._mark_suspects(conn, pipe, source, rows, batch, acked)
            retry += again
        claim.acked, claim.retry, claim.pause, claim.rewind = acked, retry, pause, rewind
        if relay.abandon.is_set():
            raise Abandoned
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
            wire.direct(conn, pipe),
            source,
            relay.refusals.failures,
            relay.refusals.suspects,
            rows,
            batch,
            acked,
        )
        relay.refusals.count_failures(0, len(done.bad), dead=len(done.dead))
        held = mark_repair.park(relay.refusals.parking, source.label, batch, done, relay.backoff,
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
            and not relay.text_ids
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
        self.relay.conns[_ahead_key(self.index)] = conn
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
    """The read-ahead session's key in `Shared.conns` (cancelled at the shutdown timeout)."""
    return -1 - index


_HORIZON = queries.horizon().as_string().encode()
_IDLE_UNLOCK = queries.idle_unlock().as_string().encode()
_TRY_IDLE_LOCK = queries.try_idle_lock().as_string().encode()
_ID = operator.itemgetter(0)
_BY_ID = operator.attrgetter("id")
"""Claim order with key ordering: by id (application ids are then claimed by id too)."""
