"""A run of batches: claim → publish → mark, back to back, one round trip each.

The worker (relay/driver.py) decides when a run starts (a session is open, shards are owned, no
pause is due) and what happens between runs (idle waits, lease checks, failures); a run goes
on while claims return rows and ends when one comes back empty, or the worker must look up
(stop, rebalance, source switch). What a run owns, and the worker reads after it: the pause to
take after its last COMMIT (`pause_s`), the bad rows to claim again (`later`), the published
batches whose mark did not commit when a run failed (`unmarked`), and the read-ahead session
(relay/read_ahead.py). What it is given: the worker's claim session (`new_session`), its
cursor, idle flag, shard lease, fence, LISTEN session and `Waits`, and the worker's idle wait
(`sleep`: returns whether it was woken and whether it blocked). Each batch is a `Batch`
(relay/batch.py); a run never waits with a transaction open (relay/waits.py).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from typing import Any

from outbox_migrate.patterns import notify
from outbox_migrate.relay import claimed, queries, read_ahead, unmarked, wire
from outbox_migrate.relay.batch import Batch, Commit, mark_and_commit
from outbox_migrate.relay.cursor import Cursor
from outbox_migrate.relay.fencing import Fence
from outbox_migrate.relay.idle_flag import SPARSE_ROWS, Idle, IdleFlag
from outbox_migrate.relay.listener import Listener
from outbox_migrate.relay.message import MessageId
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
        sleep: Callable[[float | None], tuple[bool, bool]],
    ) -> None:
        self.relay = relay
        self.index = index
        self.lease = lease
        self.cursor = cursor
        self.flag = flag
        self.fence = fence
        self.listener = listener
        self.waits = waits
        self._idle_sleep = sleep
        self.conn: Any = None
        self.wire: wire.Wire | None = None
        """The claim session's libpq-level pipeline of prepared statements (relay/wire.py)."""
        self.statements = Statements(relay.columns, by_key=relay.options.ordering is Ordering.key,
                                     text_ids=relay.text_ids)  # fmt: skip
        self.sink: Sink | None = None
        self.pause_s = 0.0
        """Wait before the next claim: the sink rejected messages that are to be retried."""
        self.blocked = False
        """The last idle wait blocked before it returned (`Listener.poll`)."""
        self.rewound = False
        """The last batch set the cursor back to a row to try again (no read-ahead then)."""
        self.later: list[MessageId] = []
        """Bad rows to try again once the backlog is drained (`retry_bad_rows`)."""
        self.unmarked: list[Commit] = []
        """Batches of the last failed run whose mark did not commit (the worker repairs)."""
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

    def run(self, source: queries.Source, sink: Sink) -> int | None:
        """One run of batches from `source` (see `_publish_run`)."""
        self.sink = sink
        return self._publish_run(source)

    def _sleep(self, timeout_s: float | None = None) -> bool:
        woken, self.blocked = self._idle_sleep(timeout_s)
        return woken

    def _lower_idle_flag(self) -> None:
        """Queue the flag's release (pipeline): a claiming relay needs no notifications."""
        key = self.flag.lower()
        if key is not None:
            assert self.wire is not None
            self.wire.send(IDLE_UNLOCK, {"key": key})

    # -- the hot path: batches back to back, one round trip each --------------------------

    def _statements(self, source: queries.Source) -> tuple[bytes, bytes, bytes, bool]:
        """Claim, probe and mark of `source` for this session (relay/statements.py)."""
        sharded = self.lease.sharded and not self.lease.owns_all
        assert self.wire is not None
        claim, probe, mark = self.statements.of(self.conn, self.wire, source, sharded)
        return claim, probe, mark, sharded

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
            pipe.send(IDLE_UNLOCK, {"key": unlock})
        raising = None
        if try_raise:
            # Writers that saw the relay busy hold the lock shared until they commit: once it
            # is ours, their rows are visible to this claim — below the cursor too (confirm).
            raising = pipe.send(TRY_IDLE_LOCK, {"key": flag.run_key})
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
        `linger_s` after the previous one was sent: steady traffic then costs one batch and
        one wake-up per linger period instead of one per message. The batch's mark and COMMIT
        leave before the wait (their results read with the next claim's): waiting with them
        queued kept the session "idle in transaction" on its row locks through nearly every
        linger, and the migration runner does not queue a step's lock behind such a session
        (tests/integration/relay/test_wake_up.py).
        A failed mark rolls back its batch only (`_repair_in_run`)."""
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
                    if self.unmarked and not self._repair_in_run(cur, pending, ahead_ok, mark):
                        cur.send_plain(b"ROLLBACK")  # the batch in hand goes out again later
                        break
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
        action = self.flag.in_run(self.cursor.due(time.monotonic()))
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
        if self.unmarked:
            return True  # a mark failed: repaired with the next claim, not after a sleep
        woken = self._sleep(timeout - HOLD_S)
        self.blocked = True  # it slept HOLD_S already
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
        self.unmarked += [c for c in pending if not c.succeeded]
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
        self.rewound = rewind is not None
        if rewind is not None:
            cursor.retry_from(rewind)
        elif retry:
            self.later += retry
            if len(rows) < relay.options.batch_size:
                self.retry_bad_rows()
        pending.append(mark_and_commit(pipe, claim))
        relay.observer.heartbeat(self.index)
        return pause, now

    def retry_bad_rows(self) -> None:
        """Bad rows to try again are claimed by id with the next claim on the lease session
        (`Cursor.retry_ids`) — once claims no longer come back full: a claim with a probe is
        not read ahead, and trying each bad row again in the very next batch cost a fifth of
        the drain rate at one bad row per 10,000 (bench/bad_rows.py)."""
        if not self.later:
            return
        self.cursor.retry_ids(self.later, time.monotonic())
        self.later = []

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
        relay, options = self.relay, self.relay.options
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
        self.relay.conns[ahead_key(self.index)] = conn
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
        """Count the batches whose COMMIT came back (a failed mark: `unmarked`; short: raise)."""
        done = [c for c in pending if c.commit.result is not None]
        for commit in done:
            pending.remove(commit)
            if commit.mark_failed:
                self.unmarked.append(commit)
            else:
                self._count(commit)
        for short in filter(None, map(Commit.fell_short, done)):
            raise short  # the worker looks at its names (relay/driver.py)

    def _repair_in_run(
        self, cur: wire.Wire, pending: list[Commit], ahead_ok: bool, mark: bytes
    ) -> bool:
        """A batch's mark failed and its COMMIT rolled it back (`mark_and_commit`): repair it
        now on the session not holding the batch in hand, and go on. Ending the run instead
        dropped the batch claimed ahead and claimed it again without overlap: a bad row cost
        three batches' time (bench/bad_rows.py). False (no read-ahead here): the run ends,
        the worker repairs."""
        if not ahead_ok:
            return False
        while self.unmarked:
            if cur is self.wire:
                conn, pipe = self.read_ahead.session((mark,))
                self.relay.conns[ahead_key(self.index)] = conn
            else:
                conn, lease_pipe = self.conn, self.wire
                assert lease_pipe is not None
                pipe = lease_pipe
            pipe.pause()  # its last COMMIT read (that batch may need a repair too)
            self._count_committed(pending)
            self.repair(conn)
        return True

    def repair(self, conn: Any, error: Exception | None = None) -> None:
        """Repair the `unmarked` batches on `conn` (relay/unmarked.py)."""
        self.later += unmarked.repair(self.relay, self.index, conn, self.unmarked, error)

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
