"""The one transition of a step's state: every ledger write of `step.state` goes through
`transition`, which refuses a move the state machine does not allow.

Why one place: writers with their own idea of which moves are fine can let a refused command
mark steps done on its way to refusing. Here the allowed moves are one table (`ALLOWED`,
pure and unit-tested), and the UPDATE itself only matches a row in an allowed state, so an
illegal move fails loudly instead of rewriting history. Call it inside the step's own
transaction to commit the state with the work.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from psycopg import Connection

from outbox_migrate.runner.ledger import HOST

STATES = ("pending", "running", "done", "failed", "rolled_back")

_NOT_DONE = frozenset({"pending", "running", "failed", "rolled_back"})
ALLOWED: dict[str, frozenset[str]] = {
    # target state: the states it may be reached from
    "running": _NOT_DONE,
    "done": _NOT_DONE,
    "failed": _NOT_DONE,
    # A step that refused at run time did nothing: it stays (or goes back to) pending, with
    # the reason for `status`.
    "pending": _NOT_DONE,
    # An inverse undoes a done step, or one proven applied outside the ledger (offline SQL).
    "rolled_back": frozenset(STATES),
}
"""Never from `done` except by rolling back: a done step is only ever undone by its inverse."""


class IllegalTransition(RuntimeError):
    """A bug, not an operator error: the runner asked for a move the state machine forbids."""


def allowed(current: str, target: str) -> bool:
    return current in ALLOWED.get(target, frozenset())


def transition(
    conn: Connection[Any],
    migration_id: int,
    step_id: str,
    target: str,
    *,
    error: str | None = None,
    started: bool = False,
    started_at: datetime | None = None,
) -> None:
    """Move one step to `target`, stamping who, where and when.

    `started` stamps the start now; `started_at` gives it (a transactional step records its
    whole life — checks, lock waits, DDL — in the one row it commits at the end). `done`
    clears the last error; other states keep it unless a new one is given."""
    if target not in ALLOWED:
        raise IllegalTransition(f"{step_id}: unknown step state {target!r}")
    if error is not None:
        error = error[:500]
    cursor = conn.execute(
        "UPDATE outbox_migrate.step SET state = %s, "
        "last_error = CASE WHEN %s::text IS NULL AND %s = 'done' THEN NULL "
        "                  ELSE coalesce(%s, last_error) END, "
        "started_at = CASE WHEN %s THEN clock_timestamp() "
        "                  ELSE coalesce(%s::timestamptz, started_at) END, "
        "finished_at = CASE WHEN %s IN ('done', 'failed', 'rolled_back') "
        "                   THEN clock_timestamp() END, "
        "duration_ms = CASE WHEN %s IN ('done', 'failed', 'rolled_back') "
        "AND coalesce(%s::timestamptz, started_at) IS NOT NULL THEN 1000 * extract(epoch FROM "
        "clock_timestamp() - coalesce(%s::timestamptz, started_at)) END, "
        "operator = current_user, host = %s "
        "WHERE migration_id = %s AND step_id = %s AND state = ANY(%s)",
        (target, error, target, error, started, started_at, target, target,
         started_at, started_at, HOST, migration_id, step_id, sorted(ALLOWED[target])),
    )  # fmt: skip
    if cursor.rowcount != 1:
        row = conn.execute(
            "SELECT state FROM outbox_migrate.step WHERE migration_id = %s AND step_id = %s",
            (migration_id, step_id),
        ).fetchone()
        found = row[0] if row else "no ledger row"
        raise IllegalTransition(f"{step_id}: {found} -> {target} is not a step transition")
