"""A polling worker's runs of batches: claim → publish → mark, one round trip each, until a
claim comes back empty or the worker must look up. A run never waits in a transaction.
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
from outbox_migrate.relay.idle_flag import SPARSE_ROWS, Idle, IdleFlag
from outbox_migrate.relay.keepalive import Fence
from outbox_migrate.relay.options import Mode, Ordering
from outbox_migrate.relay.shards import ShardLease
from outbox_migrate.relay.shared import Shared
from outbox_migrate.relay.sinks import Sink
from outbox_migrate.relay.waits import Listener, Waits

log = logging.getLogger("outbox_migrate.relay")

HOLD_S = 0.05
"""How long an idle worker leaves its last COMMIT's result unread (`BatchLoop._hold`)."""


HORIZON = queries.horizon().as_string().encode()
IDLE_UNLOCK = queries.named("idle-unlock").as_string().encode()
TRY_IDLE_LOCK = queries.try_idle_lock().as_string().encode()
_ID = operator.itemgetter(0)


class Statements:
    """Claim, gap probe and mark of each source, rendered and prepared once per session
    (PQprepare is synchronous): both cost more than a small batch's SQL."""

    def __init__(self, columns: dict[str, queries.Columns], *, by_key: bool, text_ids: bool):
        self._columns = columns
        self._by_key = by_key
        self._text_ids = text_ids
        self._rendered: dict[tuple[str, bool], tuple[bytes, bytes, bytes]] = {}

    def reset(self) -> None:
        self._rendered.clear()

    def of(
        self, conn: Any, pipe: wire.Wire, source: queries.Source, sharded: bool
    ) -> tuple[bytes, bytes, bytes]:
        key = (source.label, sharded)
        rendered = self._rendered.get(key)
        if rendered is None:
            columns = self._columns[source.label]
            claim = queries.claim(source, columns, sharded=sharded, by_key=self._by_key)
            rendered = (
                claim.as_bytes(conn),
                queries.probe(source, columns).as_bytes(conn),
                queries.mark(source).as_bytes(conn),
            )
            self._rendered[key] = rendered
            # The gap probe and the horizon only where the cursor uses them (integer ids).
            used = [rendered[0], rendered[2], IDLE_UNLOCK, TRY_IDLE_LOCK]
            if not self._text_ids:
                used += [rendered[1], HORIZON]
            for statement in used:
                pipe.prepare(statement)
        return rendered


class Abandoned(Exception):
    """Raised inside a worker's transaction after the shutdown timeout: roll back, exit."""


@dataclass
class _Run:
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

    def new_session(self, conn: Any, pipe: wire.Wire) -> None:
        self.conn, self.wire = conn, pipe
        self.statements.reset()

    # -- the hot path: batches back to back, one round trip each --------------------------

    def _claim(self, run: _Run) -> None:
        """BEGIN, the due gap probe, the range claim and the idle flag's move: one round trip."""
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
        # The server starts its idle-in-transaction timer only after a Sync: without one a
        # relay paused mid-batch would keep its session (and shards) for good.
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
        """Queue the idle flag's move ahead of the claim's BEGIN; the slot of its raise. Raised
        so, the claim's snapshot is taken with the flag up: every row it cannot see will
        notify, so an empty claim may sleep at once (docs/relay.md, "Why the trigger is
        usually quiet")."""
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
        """Batch after batch until a claim comes back empty (returns its `after`) or the
        worker must look up (None). A batch counts once its COMMIT's result arrived: results
        come in order, so a failing next claim leaves no doubt about it."""
        pipe, self.sink = self.wire, sink
        assert pipe is not None  # opened by `Worker._step` before any run
        sharded = self.lease.sharded and not self.lease.owns_all
        claim, probe, mark = self.statements.of(self.conn, pipe, source, sharded)
        linger = self._linger_s(source)
        run = _Run(source, claim, probe, mark, sharded, linger, self._flag_rows(source),
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
        """Publish the batch in hand, queue its mark and COMMIT, claim the next. False: run ends."""
        state = self.state
        if run.pending:
            self._count_committed(run.pending)
        if state.unmarked and not self._repair_in_run(run):
            run.cur.send_plain(b"ROLLBACK")  # the batch in hand goes out again later
            return False
        if not run.rows:
            return self._claimed_nothing(run)
        if len(run.rows) > run.flag_rows:
            # More than a trickle: writers need not notify while the worker claims.
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
        """Take the batch claimed ahead, end the run (False), or claim on the lease session."""
        if ahead is not None and (pause or look_up or self.state.rewound):
            # The batch claimed ahead rolls back unpublished, to be claimed again later.
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
        """Finish the read-ahead session's transaction before the lease session claims (a
        claim from id 0 must not meet rows that move under it)."""
        pipe = self.wire
        if run.cur is not pipe:
            assert pipe is not None
            run.cur.sync()
            run.conn, run.cur = self.conn, pipe

    def _must_look_up(self, source: queries.Source, now: float) -> bool:
        relay = self.relay
        return relay.stopping or self.lease.due(now) or relay.state.current is not source

    def _flag_rows(self, source: queries.Source) -> int:
        """Rows a claim with the flag up may return for the worker to sleep in the run; -1:
        not in the run (the switching relay's empty flat claim starts the switch)."""
        state = self.relay.state
        if not self.flag.enabled or (state.mode is Mode.switching and source is state.flat):
            return -1
        return SPARSE_ROWS

    def _wait_in_run(self, run: _Run) -> bool:
        """Wait in the run, so an idle worker costs one round trip per wake-up. True: the
        worker must go back to `_step` first."""
        action = self.flag.in_run(self.cursor.due(time.monotonic()))
        pipe, pending, linger = run.cur, run.pending, run.linger
        self.state.to(Phase.IDLE)
        if action is Idle.SLEEP:
            woken = self._hold(pipe, pending, None)
            self.flag.slept(blocked=self.state.blocked)
            if woken and linger > 0:
                # A trickle costs one claim per linger period, not one per row.
                self._linger([], time.monotonic() + linger)
        elif action is Idle.BUSY_POLL:
            # An uncommitted writer holds the flag shared (and will not notify): look again.
            self._hold(pipe, pending, self.flag.busy_poll_s())
        self.relay.observer.heartbeat(self.index)
        self.state.to(Phase.CLAIMING)
        return bool(self.state.pause_s) or self._must_look_up(run.source, time.monotonic())

    def _hold(self, pipe: wire.Wire, pending: list[Commit], timeout_s: float | None) -> bool:
        """Sleep once the last COMMIT (or ROLLBACK) went out: sleeping in the transaction
        would hold its locks against a migration step's DDL. True: woken."""
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
        """A run failed: roll back both sessions, count what committed, keep the rest to repair."""
        self.read_ahead.abandon()
        for commit in pending:
            if commit.succeeded:
                self._count(commit)
        self.state.unmarked += [c for c in pending if not c.succeeded]
        self._end_transaction()

    def _publish_batch(
        self, conn: Any, pipe: wire.Wire, claim: Batch, pending: list[Commit]
    ) -> tuple[float, float]:
        """Publish the claimed rows, queue their mark and COMMIT; the pause due after the
        transaction, and the time."""
        relay, cursor = self.relay, self.cursor
        source, rows, after = claim.source, claim.rows, claim.after
        batch, bad = claimed.messages(rows, relay.message, relay.columns[source.label])
        claim.messages = batch
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
        claim.acked = acked
        if relay.abandon.is_set():
            raise Abandoned
        now = time.monotonic()
        cursor.claimed(after, list(map(_ID, rows)), now)
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
        """Claim bad rows again by id with the next lease-session claim."""
        state = self.state
        if state.later:
            self.cursor.retry_ids(state.later, time.monotonic())
            state.later = []

    def _read_ahead_allowed(self, source: queries.Source) -> bool:
        """Not with ordering (a rejection would meet a batch claimed behind it), application
        ids (no cursor), or while the switching relay drains the flat table."""
        relay, options = self.relay, self.relay.options
        return (
            options.read_ahead
            and options.ordering is Ordering.none
            and not relay.text_ids
            and not (relay.state.mode is Mode.switching and source is relay.state.flat)
        )

    def _send_ahead(self, run: _Run) -> read_ahead.Pending | None:
        relay = self.relay
        if not run.ahead_ok or run.ranged < relay.options.batch_size:
            return None  # a short claim: rows are not waiting
        now = time.monotonic()
        if (
            self.state.pause_s
            or self._must_look_up(run.source, now)
            or self.listener.take()
            or not self.cursor.plain(now)
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
            # The switch needs an empty claim, which steady traffic and a linger never give.
            return 0.0
        return relay.options.linger_s

    def _linger(self, pending: list[Commit], until: float) -> bool:
        """Send the mark and COMMIT, then wait until `until` (True: a stop): a linger in the
        transaction would hold locks the migration runner will not queue behind."""
        assert self.wire is not None
        self.wire.send_sync()
        if pending:
            pending[-1].sent = time.perf_counter()
        return self.waits.sleep(until - time.monotonic())  # plain when short (waits.py)

    def _count_committed(self, pending: list[Commit]) -> None:
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
        """Repair a failed mark on the other session and go on (ending the run would drop the
        batch claimed ahead). False: the worker repairs."""
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
        state = self.state
        state.later += unmarked.repair(self.relay, self.index, conn, state.unmarked, error)

    def _count(self, commit: Commit) -> None:
        relay = self.relay
        unmarked.committed(relay, commit.batch)
        relay.stats.batch(commit.published)
        relay.observer.published(commit.published)
        relay.observer.batch_seconds((commit.sent or time.perf_counter()) - commit.batch.started)

    def _end_transaction(self) -> None:
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
