"""A polling worker's runs of batches: claim → publish → mark, back to back, one round trip each.

The worker (relay/driver.py) decides when a run starts (a session is open, shards are owned, no
pause is due) and what happens between runs (idle waits, lease checks, failures); a run goes
on while claims return rows and ends when one comes back empty, or the worker must look up
(stop, rebalance, source switch). Worker and runs share one `WorkerState` (relay/batch.py).
A run is given the worker's claim session (`new_session`), its cursor, idle flag, shard lease,
fence, LISTEN session, `Waits` and idle wait (`sleep`: whether it was woken and whether it
blocked). A run never waits with a transaction open (relay/waits.py).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox_migrate.patterns import notify
from outbox_migrate.relay import claimed, queries, read_ahead, unmarked, wire
from outbox_migrate.relay.batch import Batch, Commit, Phase, WorkerState, mark_and_commit
from outbox_migrate.relay.cursor import Cursor
from outbox_migrate.relay.fencing import Fence
from outbox_migrate.relay.idle_flag import SPARSE_ROWS, Idle, IdleFlag
from outbox_migrate.relay.listener import Listener
from outbox_migrate.relay.options import Mode, Ordering
from outbox_migrate.relay.shards import ShardLease
from outbox_migrate.relay.shared import Shared
from outbox_migrate.relay.sinks import Sink
from outbox_migrate.relay.statements import HORIZON, IDLE_UNLOCK, TRY_IDLE_LOCK, Statements
from outbox_migrate.relay.waits import Waits

log = logging.getLogger("outbox_migrate.relay")

HOLD_S = 0.05
"""How long an idle worker leaves its last COMMIT's result unread for the next claim to read
with its own; then it reads it (see `BatchLoop._hold`)."""


class Abandoned(Exception):
    """Raised inside a worker's transaction after the shutdown timeout: roll back, exit."""


@dataclass
class _Run:
    """A run in progress: what its loop carries from one batch to the next."""

    source: queries.Source
    claim: bytes
    probe: bytes
    mark: bytes
    sharded: bool
    linger: float
    flag_rows: int
    ahead_ok: bool
    conn: Any
    """The session holding the batch in hand: the lease session, or the read-ahead one."""
    cur: wire.Wire
    pending: list[Commit] = field(default_factory=list)
    """Batches whose COMMIT was queued and not yet seen to succeed (one per session)."""
    rows: list[Any] = field(default_factory=list)
    after: int = 0
    ranged: int = 0
    started: float = 0.0
    sent: float = 0.0
    empty_after: int | None = None


class BatchLoop:
    """One worker's runs of batches (one per worker, across its sessions)."""

    def __init__(
        self,
        relay: Shared,
        index: int,
        *,
        lease: ShardLease,
        cursor: Cursor,
        flag: IdleFlag,
        fence: Fence,
        listener: Listener,
        waits: Waits,
        sleep: Callable[[float | None], bool],
        state: WorkerState,
    ) -> None:
        self.relay = relay
        self.index = index
        self.lease = lease
        self.cursor = cursor
        self.flag = flag
        self.fence = fence
        self.listener = listener
        self.waits = waits
        self._sleep = sleep
        self.conn: Any = None
        self.wire: wire.Wire | None = None
        """The claim session's libpq-level pipeline of prepared statements (relay/wire.py)."""
        self.statements = Statements(relay.columns, by_key=relay.options.ordering is Ordering.key,
                                     text_ids=relay.text_ids)  # fmt: skip
        self.sink: Sink | None = None
        self.state = state
        options = relay.options
        self.read_ahead = read_ahead.ReadAhead(
            read_ahead.open_session(
                relay.connect_worker, options.dead_session_s, options.poll_interval_s
            )
        )
        """The worker's second session, claiming the next batch while one is published."""

    def new_session(self, conn: Any, pipe: wire.Wire) -> None:
        """The worker (re)opened its claim session: statements are rendered for it anew."""
        self.conn, self.wire = conn, pipe
        self.statements.reset()

    # -- the hot path: batches back to back, one round trip each --------------------------

    def _claim(self, run: _Run) -> None:
        """Queue BEGIN and the claim, send everything queued; the claimed rows, the `after`
        the range claim started from and how many rows that range claim returned go to `run`.

        When the cursor's gap probe is due, the remembered gaps are claimed by id in the same
        transaction and round trip, ahead of the range claim (they are all below it); the idle
        flag moves in the same network write (`_queue_flag`).
        """
        relay, cursor, pipe = self.relay, self.cursor, self.wire
        assert pipe is not None
        run.started, run.sent = time.perf_counter(), time.monotonic()
        self.listener.take()
        flag = self.flag
        raising = self._queue_flag(pipe, run.flag_rows)
        now = time.monotonic()
        after = cursor.start(now)
        gaps = cursor.probe(now) if after >= cursor.frontier else None
        params: dict[str, Any] = {"after": after, "limit": relay.options.batch_size}
        if run.sharded:
            params.update(shards=self.lease.count, mine=self.lease.mine())
        started = time.monotonic()
        pipe.send_plain(b"BEGIN")
        late = pipe.send(run.probe, {"ids": gaps}) if gaps else None
        claimed = pipe.send(run.claim, params)
        # While ids below the cursor are unaccounted for, read the horizon after the claim.
        horizon = pipe.send(HORIZON) if cursor.wants_horizon() else None
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
                found.sort(key=operator.itemgetter(0))
                rows = found + rows
        if after == 0:
            now = time.monotonic()
            cursor.rescanned(now - started, now)
        if horizon is not None:
            xmin, xmax = pipe.rows(horizon)[0]
            cursor.horizon(int(xmin), int(xmax), time.monotonic())
        flag.claimed(len(rows), run.flag_rows)
        run.rows, run.after, run.ranged = rows, after, ranged

    def _queue_flag(self, pipe: wire.Wire, flag_rows: int) -> wire.Slot | None:
        """Queue the idle flag's move ahead of the claim's BEGIN; the slot of its raise.

        With the flag in the run (`flag_rows` >= 0, see `_flag_rows`): after a claim that
        found nothing the flag goes up with this claim — `pg_try_advisory_lock` in the same
        network write — so that if this claim finds nothing (or a trickle), the worker may
        sleep at once: its snapshot is taken with the flag up, and every row it cannot see
        will notify. A raised flag stays up through claims of a trickle (SPARSE_ROWS) while
        the worker sleeps between them, and comes down in the same way (`pg_advisory_unlock`
        in the claim's write) after a bigger claim, or once the traffic no longer lets the
        worker sleep (AWAKE_WAITS)."""
        flag = self.flag
        unlock, try_raise = flag.before_claim(flag_rows)
        if unlock is not None:
            pipe.send(IDLE_UNLOCK, {"key": unlock})
        if not try_raise:
            return None
        # Writers that saw the relay busy hold the lock shared until they commit: once it is
        # ours, their rows are visible to this claim — below the cursor too (confirm).
        self.cursor.confirm()
        return pipe.send(TRY_IDLE_LOCK, {"key": flag.run_key})

    def run(self, source: queries.Source, sink: Sink) -> int | None:
        """Claim → publish → mark, batch after batch (`_batch`), until a claim comes back empty
        (returns the `after` it started from) or the worker must look up (stop, rebalance,
        switch: returns None).

        One batch is still one transaction, but the session runs in pipeline mode (prepared
        statements sent through libpq directly: relay/wire.py) with explicit BEGIN/COMMIT, so
        a batch's mark and COMMIT travel with the next batch's BEGIN and claim: one round trip
        per batch instead of four (BEGIN, claim, mark, COMMIT). A batch counts as published
        once its COMMIT is known to have succeeded: when a later result of its session arrives
        (results come back in order), or at the final sync. When the next claim fails
        (SQLSTATE 40001, a lost connection), the COMMIT before it already happened or not —
        its own result says which. A failed mark rolls back its batch only (`_repair_in_run`).
        """
        pipe, self.sink = self.wire, sink
        assert pipe is not None  # opened by `Worker._step` before any run
        sharded = self.lease.sharded and not self.lease.owns_all
        claim, probe, mark = self.statements.of(self.conn, pipe, source, sharded)
        linger = self._linger_s(source)
        run = _Run(source, claim, probe, mark, sharded, linger, self._flag_rows(source, linger),
                   self._read_ahead_allowed(source), self.conn, pipe)  # fmt: skip
        self.flag.run_key = notify.idle_lock_key(source.label)
        try:
            with pipe.pipeline():
                self._claim(run)
                while self._batch(run):
                    pass
            self.read_ahead.settle()
        except BaseException:
            self._abort_run(run.pending)
            raise
        self._count_committed(run.pending)
        return run.empty_after

    def _batch(self, run: _Run) -> bool:
        """The batch in hand: publish it, queue its mark and COMMIT, have the next one claimed
        (ahead, on the other session, while this one is published: relay/read_ahead.py).
        False: the run ends."""
        state = self.state
        if run.pending:
            self._count_committed(run.pending)
        if state.unmarked and not self._repair_in_run(run):
            run.cur.send_plain(b"ROLLBACK")  # the batch in hand goes out again later
            return False
        if not run.rows:
            return self._claimed_nothing(run)
        if len(run.rows) > run.flag_rows:
            # The claim after raising the flag found rows, or more than a sparse trickle:
            # writers need not notify while the worker claims (the release is queued).
            key = self.flag.lower()
            if key is not None and self.wire is not None:  # the lease session holds the lock
                self.wire.send(IDLE_UNLOCK, {"key": key})
        ahead = self._send_ahead(run)
        state.to(Phase.PUBLISHING)
        pause, now = self._publish_batch(
            run.conn, run.cur, Batch(run.source, run.mark, run.rows, run.after, run.started),
            run.pending,
        )  # fmt: skip
        state.to(Phase.CLAIMING)
        return self._after_publish(run, ahead, pause, self._must_look_up(run.source, now))

    def _after_publish(
        self, run: _Run, ahead: read_ahead.Pending | None, pause: float, look_up: bool
    ) -> bool:
        """Take the batch claimed ahead, or end the run (a pause, the worker must look up), or
        claim the next batch on the lease session. False: the run ends."""
        if ahead is not None and (pause or look_up or self.state.rewound):
            # Refused in part, or the worker must look up: the batch claimed ahead rolls back
            # unpublished (its rows are claimed again later).
            ahead.pipe.send_plain(b"ROLLBACK")
            ahead.pipe.send_sync()
        elif ahead is not None:
            run.cur.send_sync()  # the mark and COMMIT of the batch published
            run.started = time.perf_counter()
            run.rows = self.read_ahead.receive(ahead)
            run.after, run.ranged = ahead.after, len(run.rows)
            if ahead.pipe is self.wire:
                self.fence.proven(ahead.sent)  # a claim on the lease session proves the lease
            self.flag.claimed_ahead(len(run.rows))
            self.relay.stats.add(read_ahead=1)
            run.conn, run.cur = ahead.conn, ahead.pipe
            return True
        if pause:  # a rejection's backoff, or a claim of parked keys only
            self.state.park(pause)  # taken in `_step`, after the COMMIT
            return False
        if look_up:
            return False
        self._back_to_lease_session(run)
        short = run.ranged < self.relay.options.batch_size
        if short and self.flag.held and self._wait_in_run(run):
            return False  # a sparse row published with the flag up: slept until woken
        if short and run.linger > 0 and self._linger(run.pending, run.sent + run.linger):
            return False
        self._claim(run)
        return True

    def _claimed_nothing(self, run: _Run) -> bool:
        """The claim came back empty: end the run, or (the idle flag in the run) wait in it
        and claim again. False: the run ends."""
        run.cur.send_plain(b"ROLLBACK")
        if run.flag_rows < 0:
            run.empty_after = run.after
            return False
        self._back_to_lease_session(run)
        if self._wait_in_run(run):
            return False
        self._claim(run)
        return True

    def _back_to_lease_session(self, run: _Run) -> None:
        """The batch in hand is the read-ahead session's: its mark and COMMIT (or ROLLBACK)
        complete before the lease session claims again (a claim from id 0 must not meet rows
        that move under it)."""
        pipe = self.wire
        if run.cur is not pipe:
            assert pipe is not None
            run.cur.sync()
            run.conn, run.cur = self.conn, pipe

    def _must_look_up(self, source: queries.Source, now: float) -> bool:
        """The worker must leave the run: stop, rebalance due, source switched."""
        relay = self.relay
        return relay.stopping or self.lease.due(now) or relay.state.current is not source

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

    def _wait_in_run(self, run: _Run) -> bool:
        """Nothing more to claim now: wait — until a notification or the poll interval with
        the idle flag up, shortly without it — staying in the run (no pipeline exit, no
        statements of its own), the last COMMIT or ROLLBACK queued for the next claim to take
        along (`_hold`). True: the worker must go back to `_step` first (stop, lease check,
        source switch). The flag was up while the last claim's snapshot was taken, or this
        waits briefly (`IdleFlag.busy_poll_s`) and the next claim raises it: an idle worker
        costs one round trip per wake-up. CLAIM: a claim below the cursor is due, or the last
        claim did not try to raise the flag: claim again now (what is queued goes with it)."""
        action = self.flag.in_run(self.cursor.due(time.monotonic()))
        pipe, pending, linger = run.cur, run.pending, run.linger
        self.state.to(Phase.IDLE)
        if action is Idle.SLEEP:
            woken = self._hold(pipe, pending, None)
            self.flag.slept(blocked=self.state.blocked)
            if woken and linger > 0:
                # Woken by a row's notification: give it `linger` for company, as a batch
                # that did not fill waits before the next claim — a trickle then costs one
                # claim per linger period, not one per row.
                self._linger([], time.monotonic() + linger)
        elif action is Idle.BUSY_POLL:
            # A writer that saw the relay busy has not committed yet (it holds the flag's lock
            # shared and will not notify), or another worker holds the flag: look again soon.
            self._hold(pipe, pending, self.flag.busy_poll_s())
        self.relay.observer.heartbeat(self.index)
        self.state.to(Phase.CLAIMING)
        return bool(self.state.pause_s) or self._must_look_up(run.source, time.monotonic())

    def _hold(self, pipe: wire.Wire, pending: list[Commit], timeout_s: float | None) -> bool:
        """Sleep (`_sleep`) once the last batch's mark and COMMIT (or the empty claim's
        ROLLBACK) went out, their results read with the next claim's: one wait for the server
        per wake-up, not two. Not sent with that claim instead: the session would sleep in its
        transaction on its locks, and a migration step's DDL would never find a moment for its
        lock ("blocked by relay-0, idle in transaction"). Results not read within HOLD_S are
        read then (the batch is counted). True: woken (a notification, a stop, a failed mark).
        """
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
        if self.state.unmarked:
            return True  # a mark failed: repaired with the next claim, not after a sleep
        woken = self._sleep(timeout - HOLD_S)
        self.state.blocked = True  # it slept HOLD_S already
        return woken

    def _abort_run(self, pending: list[Commit]) -> None:
        """A run failed: roll back both sessions, count what did commit (a COMMIT of the
        read-ahead session still in flight is read first, so a batch marked is counted), and
        keep the published batches whose mark did not commit for the worker's repair
        (`Worker._repair_marks`)."""
        self.read_ahead.abandon()
        for commit in pending:
            if commit.succeeded:
                self._count(commit)
        self.state.unmarked += [c for c in pending if not c.succeeded]
        self._end_transaction()

    def _publish_batch(
        self, conn: Any, pipe: wire.Wire, claim: Batch, pending: list[Commit]
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
        direct = wire.direct(conn, pipe)
        acked, claim.letters, retry, pause, rewind, due = relay.refusals.publish(
            direct, self.sink, source, batch, bad, after
        )
        cursor.retry_at(due)  # `--ordering key`: a parked message's next attempt, on a clock
        if claim.letters or (relay.refusals.suspects and acked):
            acked, again = unmarked.before_mark(relay, direct, claim, acked)
            retry += again
        claim.acked, claim.retry, claim.pause, claim.rewind = acked, retry, pause, rewind
        if relay.abandon.is_set():
            raise Abandoned
        now = time.monotonic()
        cursor.claimed(after, [r[0] for r in rows], now)
        # After a rejection's pause, or for a released key: claim again from `rewind` (the
        # read-ahead batch, if any, is dropped). Bad rows: by id, once the backlog is drained.
        self.state.rewound = rewind is not None
        if rewind is not None:
            cursor.retry_from(rewind)
        elif retry:
            self.state.later += retry
            if len(rows) < relay.options.batch_size:
                self.retry_bad_rows()
        pending.append(mark_and_commit(pipe, claim))
        relay.observer.heartbeat(self.index)
        return pause, now

    def retry_bad_rows(self) -> None:
        """Bad rows to try again are claimed by id with the next claim on the lease session
        (`Cursor.retry_ids`) once claims no longer come back full: a claim with a probe is
        not read ahead."""
        state = self.state
        if state.later:
            self.cursor.retry_ids(state.later, time.monotonic())
            state.later = []

    def _read_ahead_allowed(self, source: queries.Source) -> bool:
        """Read-ahead keeps publishing one batch at a time in id order, but a rejection would
        meet a batch already claimed behind it: with key or global ordering (parking, strict
        order) and application ids (no cursor to claim after) it is not used."""
        relay, options = self.relay, self.relay.options
        return (
            options.read_ahead
            and options.ordering is Ordering.none
            and not relay.text_ids
            # Not while the switching relay drains the flat table to leave it: that run must
            # end with a claim that comes back empty, and it is short.
            and not (relay.state.mode is Mode.switching and source is relay.state.flat)
        )

    def _send_ahead(self, run: _Run) -> read_ahead.Pending | None:
        """While claims come back full, send the next batch's claim — a plain range claim from
        the last id in hand (rows come in id order) — on the session not holding the batch in
        hand; not when the lease session must claim first (relay/read_ahead.py)."""
        now, relay = time.monotonic(), self.relay
        if not (
            run.ahead_ok
            and run.ranged == relay.options.batch_size
            and not (self.state.pause_s or self._must_look_up(run.source, now))
            and not self.listener.take()
            and self.cursor.plain(now)
        ):
            return None
        after = max(self.cursor.frontier, run.rows[-1][0])
        params: dict[str, Any] = {"limit": relay.options.batch_size}
        if run.sharded:
            params.update(shards=self.lease.count, mine=self.lease.mine())
        if run.cur is not self.wire:
            assert self.wire is not None
            return self.read_ahead.send(self.wire, self.conn, run.claim, params, after)
        conn, pipe = self.read_ahead.session((run.claim, run.mark))
        relay.conns[ahead_key(self.index)] = conn
        return self.read_ahead.send(pipe, conn, run.claim, params, after)

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
        """Count the batches whose COMMIT came back (a failed mark: `unmarked`; short: raise)."""
        done = [c for c in pending if c.commit.result is not None]
        for commit in done:
            pending.remove(commit)
            if commit.mark_failed:
                self.state.unmarked.append(commit)
            else:
                self._count(commit)
        for short in filter(None, map(Commit.fell_short, done)):
            raise short  # the worker looks at its names (relay/driver.py)

    def _repair_in_run(self, run: _Run) -> bool:
        """A batch's mark failed and its COMMIT rolled it back (`mark_and_commit`): repair it
        now on the session not holding the batch in hand, and go on: ending the run would drop
        the batch claimed ahead. False (no read-ahead here): the run ends, the worker repairs."""
        if not run.ahead_ok:
            return False
        while self.state.unmarked:
            if run.cur is self.wire:
                conn, pipe = self.read_ahead.session((run.mark,))
                self.relay.conns[ahead_key(self.index)] = conn
            else:
                conn, lease_pipe = self.conn, self.wire
                assert lease_pipe is not None
                pipe = lease_pipe
            pipe.pause()  # its last COMMIT read (that batch may need a repair too)
            self._count_committed(run.pending)
            self.repair(conn)
        return True

    def repair(self, conn: Any, error: Exception | None = None) -> None:
        """Repair the `unmarked` batches on `conn` (relay/unmarked.py)."""
        state = self.state
        state.later += unmarked.repair(self.relay, self.index, conn, state.unmarked, error)

    def _count(self, commit: Commit) -> None:
        relay = self.relay
        unmarked.committed(relay, commit.batch)
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


def ahead_key(index: int) -> int:
    """The read-ahead session's key in `Shared.conns` (cancelled at the shutdown timeout)."""
    return -1 - index
