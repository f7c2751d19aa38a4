"""Lock-safe execution: never sit in PostgreSQL's lock queue for long.

An ALTER TABLE waiting for ACCESS EXCLUSIVE blocks every later INSERT behind it, so each
attempt runs under `SET LOCAL lock_timeout` (default 200 ms): a writer waits at most that long.
On SQLSTATE 55P03 (lock_not_available) the transaction is rolled back and retried after an
exponential backoff with full jitter, inside a per-step budget; every other error fails at
once. Each failed attempt names who held the lock, read from pg_locks + pg_stat_activity.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg import Connection, errors, sql

from outbox_migrate.patterns.model import LockMode
from outbox_migrate.runner.errors import Blocker, LockBudgetExceeded

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
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


def conflicts_with(requested: LockMode) -> frozenset[LockMode]:
    return _CONFLICTS[requested]


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


def find_blockers(
    conn: Connection[Any], relations: Sequence[tuple[str, LockMode]], schema: str
) -> list[Blocker]:
    """Sessions other than ours holding a lock that conflicts with what we request."""
    found: list[Blocker] = []
    for relation, requested in relations:
        modes = [mode.value for mode in conflicts_with(requested)]
        rows = conn.execute(
            "SELECT l.pid, coalesce(a.application_name, ''), coalesce(a.state, ''), "
            "extract(epoch FROM now() - a.xact_start), l.mode "
            "FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'relation' AND l.granted AND l.pid <> pg_backend_pid() "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND l.relation = to_regclass(%s) AND l.mode = ANY(%s) ORDER BY l.pid",
            (sql.Identifier(schema, relation).as_string(None), modes),
        ).fetchall()
        for pid, app, state, age, mode in rows:
            found.append(_blocker(pid, app, state, age, mode, relation))
    return found


def long_transactions(
    conn: Connection[Any], relations: Sequence[str], schema: str, older_than_s: float = LONG_TX_S
) -> list[Blocker]:
    """Sessions in a transaction older than `older_than_s` holding any lock on `relations`,
    or idle in transaction: an ACCESS EXCLUSIVE request would queue behind them."""
    found: list[Blocker] = []
    for relation in relations:
        rows = conn.execute(
            "SELECT DISTINCT l.pid, coalesce(a.application_name, ''), coalesce(a.state, ''), "
            "extract(epoch FROM now() - a.xact_start), l.mode "
            "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'relation' AND l.granted AND l.pid <> pg_backend_pid() "
            "AND l.relation = to_regclass(%s) "
            "AND (a.state LIKE 'idle in transaction%%' "
            "     OR now() - a.xact_start > make_interval(secs => %s)) ORDER BY l.pid",
            (sql.Identifier(schema, relation).as_string(None), older_than_s),
        ).fetchall()
        for pid, app, state, age, mode in rows:
            found.append(_blocker(pid, app, state, age, mode, relation))
    return found


def _blocker(pid: Any, app: Any, state: Any, age: Any, mode: Any, relation: str) -> Blocker:
    return Blocker(
        int(pid),
        str(app),
        str(state),
        float(age) if age is not None else None,
        str(mode),
        relation,
    )


def backoff_s(attempt: int, rng: random.Random) -> float:
    """Exponential backoff with full jitter: uniform(0, min(cap, base * 2**attempt))."""
    return rng.uniform(0.0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * (2**attempt)))


def run_with_lock_budget(
    conn: Connection[Any],
    step_id: str,
    budget: LockBudget,
    body: Callable[[Connection[Any]], None],
    *,
    relations: Sequence[tuple[str, LockMode]],
    schema: str,
    on_attempt: Callable[[AttemptLog], None] | None = None,
    rng: random.Random | None = None,
) -> float:
    """Run `body` in a transaction with the step's timeouts; retry only on lock_not_available.

    Returns the milliseconds spent waiting for locks in failed attempts. Raises
    `LockBudgetExceeded` (nothing applied) when the budget runs out; any other error
    propagates after the rollback.
    """
    rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
    started = time.monotonic()
    waited_ms = 0.0
    attempt = 0
    last_blockers: list[Blocker] = []
    while True:
        attempt += 1
        attempt_started = time.monotonic()
        try:
            with conn.transaction():
                conn.execute(
                    sql.SQL("SET LOCAL lock_timeout = {}").format(
                        sql.Literal(f"{budget.lock_timeout_ms}ms")
                    )
                )
                statement_ms = budget.statement_timeout_ms or 0
                conn.execute(
                    sql.SQL("SET LOCAL statement_timeout = {}").format(
                        sql.Literal(f"{statement_ms}ms")
                    )
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
            pause = backoff_s(attempt, rng)
            if time.monotonic() - started + pause > budget.budget_s:
                raise LockBudgetExceeded(
                    step_id, attempt, time.monotonic() - started, last_blockers
                ) from None
            time.sleep(pause)
