"""Lock-safe execution: never sit in PostgreSQL's lock queue for long (docs/runner.md, "Lock
safety"). The one lock-budget primitive, used by the runner's steps and inverses, the jobs and
the relay's switch: it sits below all of them and the pattern catalog and imports none of them.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from psycopg import Connection, errors, sql

from outbox_migrate import __version__
from outbox_migrate.backoff import backoff_s
from outbox_migrate.errors import Blocker, LockBudgetExceeded


class LockMode(StrEnum):
    """PostgreSQL table lock modes, weakest first (the names `pg_locks.mode` uses)."""

    ACCESS_SHARE = "AccessShareLock"
    ROW_SHARE = "RowShareLock"
    ROW_EXCLUSIVE = "RowExclusiveLock"
    SHARE_UPDATE_EXCLUSIVE = "ShareUpdateExclusiveLock"
    SHARE = "ShareLock"
    SHARE_ROW_EXCLUSIVE = "ShareRowExclusiveLock"
    EXCLUSIVE = "ExclusiveLock"
    ACCESS_EXCLUSIVE = "AccessExclusiveLock"

    @property
    def blocks_writers(self) -> bool:
        """True when INSERT/UPDATE (RowExclusiveLock) must wait for this lock."""
        return self in {
            LockMode.SHARE,
            LockMode.SHARE_ROW_EXCLUSIVE,
            LockMode.EXCLUSIVE,
            LockMode.ACCESS_EXCLUSIVE,
        }

    @property
    def sql_name(self) -> str:
        """The mode as written in LOCK TABLE (`ACCESS EXCLUSIVE`)."""
        return re.sub(r"(?<=.)(?=[A-Z])", " ", self.value.removesuffix("Lock")).upper()


BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
BLOCKER_POLL_S = 0.05
"""How often a known conflicting holder is looked for again while we wait for it to go."""
WATCH_APPLICATION_NAME = f"outbox-migrate/{__version__} status --watch"
"""`status --watch`'s sessions: each of its reads holds its lock for less than the lock
timeout (watch.py), so it is never why an attempt timed out and is never named as a holder.
Under the tool's prefix: a switching relay does not count a watch run as the owner as a
writer no REVOKE stops (relay/switching.py TOOL_SESSIONS_LIKE)."""
LONG_TX_S = 1.0
"""A transaction open longer than this, holding a lock on our relations, is reported before
an ACCESS EXCLUSIVE step (it would keep our queued lock — and all writers — waiting)."""

# Which held modes conflict with a requested mode (PostgreSQL's table-level lock matrix).
_CONFLICTS: dict[LockMode, frozenset[LockMode]] = {
    LockMode.ACCESS_SHARE: frozenset({LockMode.ACCESS_EXCLUSIVE}),
    LockMode.ROW_SHARE: frozenset({LockMode.EXCLUSIVE, LockMode.ACCESS_EXCLUSIVE}),
    LockMode.ROW_EXCLUSIVE: frozenset(
        {LockMode.SHARE, LockMode.SHARE_ROW_EXCLUSIVE, LockMode.EXCLUSIVE,
         LockMode.ACCESS_EXCLUSIVE}
    ),
    LockMode.SHARE_UPDATE_EXCLUSIVE: frozenset(
        {LockMode.SHARE_UPDATE_EXCLUSIVE, LockMode.SHARE, LockMode.SHARE_ROW_EXCLUSIVE,
         LockMode.EXCLUSIVE, LockMode.ACCESS_EXCLUSIVE}
    ),
    LockMode.SHARE: frozenset(
        {LockMode.ROW_EXCLUSIVE, LockMode.SHARE_UPDATE_EXCLUSIVE, LockMode.SHARE_ROW_EXCLUSIVE,
         LockMode.EXCLUSIVE, LockMode.ACCESS_EXCLUSIVE}
    ),
    LockMode.SHARE_ROW_EXCLUSIVE: frozenset(set(LockMode) - {LockMode.ACCESS_SHARE,
                                                              LockMode.ROW_SHARE}),
    LockMode.EXCLUSIVE: frozenset(set(LockMode) - {LockMode.ACCESS_SHARE}),
    LockMode.ACCESS_EXCLUSIVE: frozenset(LockMode),
}  # fmt: skip


@dataclass(frozen=True)
class LockBudget:
    """The typed lock budget of one step, enforced by PostgreSQL itself."""

    lock_timeout_ms: int = 200
    budget_s: float = 60.0
    statement_timeout_ms: int | None = None


@dataclass
class AttemptLog:
    attempt: int
    waited_ms: float
    outcome: str
    blockers: list[Blocker] = field(default_factory=list)


_HIDDEN_FROM = "CASE WHEN a.pid IS NOT NULL AND a.backend_type IS NULL THEN current_user END"
"""SQL: our role's name when pg_stat_activity hides the session's activity from it (every
session, even a background worker's, has a backend_type for a viewer allowed to see it)."""


def _holders(
    conn: Connection[Any], schema: str, which: str, relations: Sequence[tuple[str, Any]]
) -> list[Blocker]:
    """Other sessions' granted locks on each relation for which `which` holds (SQL on `l`
    pg_locks and `a` pg_stat_activity; its one parameter comes with the relation)."""
    found: list[Blocker] = []
    for relation, parameter in relations:
        rows = conn.execute(
            "SELECT DISTINCT l.pid, coalesce(a.application_name, ''), coalesce(a.state, ''), "
            f"extract(epoch FROM now() - a.xact_start), l.mode, {_HIDDEN_FROM} "
            "FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'relation' AND l.granted AND l.pid <> pg_backend_pid() "
            "AND l.relation = to_regclass(%s) AND a.application_name IS DISTINCT FROM %s "
            f"AND {which} ORDER BY l.pid",
            (sql.Identifier(schema, relation).as_string(None), WATCH_APPLICATION_NAME, parameter),
        ).fetchall()
        found += [
            Blocker(int(pid), str(app), str(state), float(age) if age is not None else None,
                    str(mode), relation, str(hidden or ""))
            for pid, app, state, age, mode, hidden in rows
        ]  # fmt: skip
    return found


def find_blockers(
    conn: Connection[Any], relations: Sequence[tuple[str, LockMode]], schema: str
) -> list[Blocker]:
    """Sessions other than ours holding a lock that conflicts with what we request."""
    conflicting = "l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    conflicting += " AND l.mode = ANY(%s)"
    wanted = [(relation, [m.value for m in _CONFLICTS[mode]]) for relation, mode in relations]
    return _holders(conn, schema, conflicting, wanted)


def long_transactions(
    conn: Connection[Any], relations: Sequence[str], schema: str
) -> list[Blocker]:
    """Sessions in a transaction older than `LONG_TX_S` holding any lock on `relations`,
    or idle in transaction: an ACCESS EXCLUSIVE request would queue behind them.

    A holder whose activity is hidden from our role is returned too (`hidden_from` set): we
    cannot tell whether it is one, and a guard must not pass on what it cannot see."""
    long = (
        "a.pid IS NOT NULL AND (a.state LIKE 'idle in transaction%%' OR a.backend_type IS NULL "
        "OR now() - a.xact_start > make_interval(secs => %s))"
    )
    return _holders(conn, schema, long, [(relation, LONG_TX_S) for relation in relations])


def lock_declared(
    conn: Connection[Any], relations: Sequence[tuple[str, LockMode]], schema: str, parent: str
) -> None:
    """Take the step's declared locks, first statement of its transaction, so that every
    check after this sees the state that will hold at commit.

    `LOCK TABLE ONLY` takes exactly what the DDL takes (not the partitions' locks too). The
    partitioned parent comes first, as PostgreSQL itself and the application's inserts lock
    parent before partition; locking a partition first could deadlock with an INSERT. A
    relation that does not exist yet is the one the step creates: nothing to lock.
    """
    ordered = sorted(relations, key=lambda item: 0 if item[0] == parent else 1)
    seen: set[str] = set()
    for relation, mode in ordered:
        if relation in seen:
            continue
        seen.add(relation)
        name = sql.Identifier(schema, relation)
        found = conn.execute("SELECT to_regclass(%s)", (name.as_string(None),)).fetchone()
        if found is None or found[0] is None:
            continue
        conn.execute(sql.SQL("LOCK TABLE ONLY {} IN {} MODE").format(name, sql.SQL(mode.sql_name)))


def lasting(blockers: list[Blocker], min_age_s: float) -> list[Blocker]:
    """The holders worth waiting for without queueing: idle in transaction, or in a
    transaction older than `min_age_s` (the lock_timeout). An INSERT that holds its lock for
    a millisecond is not one — queueing behind it costs writers nothing, and under steady
    traffic such holders are always there, so waiting for none would never end."""
    return [
        b
        for b in blockers
        if b.state.startswith("idle in transaction")
        or (b.xact_age_s is not None and b.xact_age_s >= min_age_s)
    ]


def wait_while_blocked(
    conn: Connection[Any],
    relations: Sequence[tuple[str, LockMode]],
    schema: str,
    deadline: float,
    on_wait: Callable[[list[Blocker]], None] | None = None,
    min_age_s: float = 0.0,
) -> list[Blocker]:
    """Watch, without queueing, until no session holds a lock conflicting with ours for
    longer than `min_age_s` (see `lasting`), or the deadline passes. Returns the holders
    still there at the deadline (empty: go ahead)."""
    reported: frozenset[int] = frozenset()
    while True:
        blockers = lasting(find_blockers(conn, relations, schema), min_age_s)
        if not blockers or time.monotonic() >= deadline:
            return blockers
        pids = frozenset(b.pid for b in blockers)
        if on_wait is not None and pids != reported:
            on_wait(blockers)
            reported = pids
        time.sleep(min(BLOCKER_POLL_S, max(0.0, deadline - time.monotonic())))


def run_with_lock_budget(
    conn: Connection[Any],
    step_id: str,
    budget: LockBudget,
    body: Callable[[Connection[Any]], object],
    *,
    relations: Sequence[tuple[str, LockMode]],
    schema: str,
    on_attempt: Callable[[AttemptLog], None] | None = None,
    rng: random.Random | None = None,
    watch_blockers: bool = True,
) -> float:
    """Run `body` in a transaction with the step's timeouts; retry only on lock_not_available.

    Returns the milliseconds spent waiting for locks (failed attempts and watching a known
    holder). Raises `LockBudgetExceeded` (nothing applied) when the budget runs out; any other
    error propagates after the rollback.
    """
    rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
    started = time.monotonic()
    deadline = started + budget.budget_s
    waited_ms = 0.0
    attempt = 0
    last_blockers: list[Blocker] = []
    # Inside a transaction someone else owns (Alembic), our own session may hold locks on
    # these relations already; watching for "other" holders is still right, as pg_locks
    # excludes our pid.
    while True:
        attempt += 1
        if watch_blockers and relations:
            watch_started = time.monotonic()

            def report(blockers: list[Blocker], number: int = attempt) -> None:
                if on_attempt:
                    on_attempt(AttemptLog(number, 0.0, "waiting", blockers))

            still = wait_while_blocked(
                conn, relations, schema, deadline, report,
                min_age_s=budget.lock_timeout_ms / 1000,
            )  # fmt: skip
            waited_ms += (time.monotonic() - watch_started) * 1000
            if still:
                raise LockBudgetExceeded(step_id, attempt, time.monotonic() - started, still)
        attempt_started = time.monotonic()
        try:
            with conn.transaction():
                # SET LOCAL both: they end with this transaction, whatever its end.
                conn.execute(
                    "SELECT set_config('lock_timeout', %s, true), "
                    "set_config('statement_timeout', %s, true)",
                    (f"{budget.lock_timeout_ms}ms", f"{budget.statement_timeout_ms or 0}ms"),
                )
                body(conn)
            if on_attempt:
                elapsed = (time.monotonic() - attempt_started) * 1000
                on_attempt(AttemptLog(attempt, elapsed, "done"))
            return waited_ms
        except errors.LockNotAvailable:
            elapsed_ms = (time.monotonic() - attempt_started) * 1000
            waited_ms += elapsed_ms
            last_blockers = find_blockers(conn, relations, schema)
            if on_attempt:
                on_attempt(AttemptLog(attempt, elapsed_ms, "lock_timeout", last_blockers))
            # Full jitter: uniform(0, min(cap, base * 2**attempt)).
            pause = backoff_s(
                attempt, base_s=BACKOFF_BASE_S, cap_s=BACKOFF_CAP_S, rng=rng, full_jitter=True
            )
            if time.monotonic() + pause > deadline:
                raise LockBudgetExceeded(
                    step_id, attempt, time.monotonic() - started, last_blockers
                ) from None
            time.sleep(pause)
