"""The ledger: the runner's progress, stored in the target database beside the work. Every
write of a step's state goes through `transition`.
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, LiteralString

from psycopg import Connection, sql
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from outbox_migrate import sql as queries
from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import UsageError
from outbox_migrate.patterns.model import Pattern, PublicationFact
from outbox_migrate.runner.decide import check_definitions

log = logging.getLogger("outbox_migrate.runner")

SCHEMA = "outbox_migrate"
LEDGER_VERSION = 3
_SETUP_LOCK_KEY = 0x6F6D6C67  # "omlg": serialises ledger creation/upgrade
HOST = socket.gethostname()


@dataclass(frozen=True)
class MigrationRow:
    id: int
    table_schema: str
    table_name: str
    pattern: str
    state: str
    current_phase: str
    created_at: datetime
    updated_at: datetime
    operator: str
    host: str | None


@dataclass(frozen=True)
class StepRow:
    step_id: str
    position: int
    phase: str
    kind: str
    checksum: str
    state: str
    attempts: int
    started_at: datetime | None
    finished_at: datetime | None
    duration_ms: float | None
    lock_wait_ms: float
    last_error: str | None
    operator: str | None
    host: str | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def ledger_exists(conn: Connection[Any]) -> bool:
    row = conn.execute("SELECT to_regclass('outbox_migrate.migration') IS NOT NULL").fetchone()
    return bool(row and row[0])


def ensure_schema(conn: Connection[Any]) -> None:
    """Create or upgrade the ledger schema (idempotent; safe under concurrency)."""
    with conn.transaction():
        # Two first runs would race on the schema's creation and upgrades.
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SETUP_LOCK_KEY,))
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(SCHEMA)))
        versions = sql.Identifier(SCHEMA, "ledger_version")
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} (version int NOT NULL)").format(versions)
        )
        row = conn.execute(sql.SQL("SELECT max(version) FROM {}").format(versions)).fetchone()
        current = int(row[0]) if row and row[0] is not None else 0
        for version in range(current + 1, LEDGER_VERSION + 1):
            for statement in queries.query("ledger", f"upgrade-{version}").text.split(";\n"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(versions), (version,))


def _migration(conn: Connection[Any], query: LiteralString, *params: Any) -> MigrationRow | None:
    """The one migration row `query` returns (`SELECT *`, `RETURNING *`), or None."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(query, params).fetchone()
    return MigrationRow(**{k: row[k] for k in MigrationRow.__dataclass_fields__}) if row else None


def active_for_table(conn: Connection[Any], spec: OutboxSpec) -> MigrationRow | None:
    return _migration(
        conn, "SELECT * FROM outbox_migrate.migration "
        "WHERE table_schema = %s AND table_name = %s AND state = 'active'", spec.schema, spec.table,
    )  # fmt: skip


def latest(conn: Connection[Any], spec: OutboxSpec, pattern: str | None) -> MigrationRow | None:
    """The active or completed migration of this table with this pattern (None: any)."""
    return _migration(
        conn, "SELECT * FROM outbox_migrate.migration WHERE table_schema = %s AND table_name = %s "
        "AND pattern = coalesce(%s, pattern) AND state <> 'abandoned' ORDER BY id DESC LIMIT 1",
        spec.schema, spec.table, pattern,
    )  # fmt: skip


def another_active(spec: OutboxSpec, pattern: str, phase: str) -> UsageError:
    return UsageError(
        f"a {pattern.upper()} migration of {spec.schema}.{spec.table} is active (phase {phase}); "
        "finish it, roll it back, or `outbox-migrate reset` it before starting another pattern"
    )


def open_migration(
    conn: Connection[Any],
    pattern: Pattern,
    spec: OutboxSpec,
    extra: dict[str, Any] | None = None,
) -> MigrationRow:
    """Find this (table, pattern) migration or start it; refuse a different active pattern."""
    active = active_for_table(conn, spec)
    if active is not None and active.pattern != pattern.name:
        raise another_active(spec, active.pattern, active.current_phase)
    existing = latest(conn, spec, pattern.name)
    if existing is not None:
        return existing
    spec_json = json.dumps({**asdict(spec), **(extra or {})}, sort_keys=True)
    created = _migration(
        conn, "INSERT INTO outbox_migrate.migration "
        "(table_schema, table_name, pattern, spec, current_phase, host) "
        "VALUES (%s, %s, %s, %s, %s, %s) RETURNING *",
        spec.schema, spec.table, pattern.name, spec_json, pattern.phases[0].name, HOST,
    )  # fmt: skip
    assert created is not None
    return created


def sync_steps(conn: Connection[Any], migration: MigrationRow, pattern: Pattern) -> None:
    """Make the ledger list exactly the pattern's steps. A pending step whose definition
    changed is updated (it has not run); an applied one is refused (`check_definitions`)."""
    by_id = step_rows(conn, migration.id)
    check_definitions(pattern, {i: (r.state, r.checksum) for i, r in by_id.items()})
    for position, step in enumerate(pattern.steps()):
        checksum = step.checksum()
        row = by_id.get(step.id)
        if row is None:
            conn.execute(
                "INSERT INTO outbox_migrate.step "
                "(migration_id, position, step_id, phase, kind, checksum) "
                "VALUES (%s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (migration_id, step_id) DO NOTHING",
                (migration.id, position, step.id, step.phase, step.kind, checksum),
            )
            continue
        if row.checksum != checksum and row.state == "done":
            log.info(
                "runner.step_adopted step=%s recorded=%s current=%s (an earlier release's "
                "definition with the same effect)",
                step.id, row.checksum, checksum,
            )  # fmt: skip
        conn.execute(
            "UPDATE outbox_migrate.step SET checksum = %s, position = %s "
            "WHERE migration_id = %s AND step_id = %s",
            (checksum, position, migration.id, step.id),
        )


def steps(conn: Connection[Any], migration_id: int) -> list[StepRow]:
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            "SELECT * FROM outbox_migrate.step WHERE migration_id = %s ORDER BY position",
            (migration_id,),
        ).fetchall()
    return [StepRow(**{k: r[k] for k in StepRow.__dataclass_fields__}) for r in rows]


def step_rows(conn: Connection[Any], migration_id: int) -> dict[str, StepRow]:
    return {row.step_id: row for row in steps(conn, migration_id)}


def record_lock_wait(conn: Connection[Any], migration_id: int, step_id: str, ms: float) -> None:
    """Record the time a step's successful run lost waiting for its locks (not its state:
    see `transition`)."""
    conn.execute(
        "UPDATE outbox_migrate.step SET lock_wait_ms = %s WHERE migration_id = %s AND step_id = %s",
        (ms, migration_id, step_id),
    )


def record_attempt(
    conn: Connection[Any],
    migration_id: int,
    step_id: str,
    attempt: int,
    outcome: str,
    waited_ms: float,
    blockers: list[dict[str, Any]],
) -> None:
    conn.execute(
        "INSERT INTO outbox_migrate.attempt "
        "(migration_id, step_id, attempt, outcome, waited_ms, blockers) "
        "VALUES (%s, %s, %s, %s, %s, %s)",
        (migration_id, step_id, attempt, outcome, waited_ms, json.dumps(blockers)),
    )
    conn.execute(
        "UPDATE outbox_migrate.step SET attempts = attempts + 1 "
        "WHERE migration_id = %s AND step_id = %s",
        (migration_id, step_id),
    )


def _recorded(conn: Connection[Any], spec: OutboxSpec, key: str) -> tuple[Any] | None:
    """`key` of the spec the table's latest live migration recorded (None: no migration)."""
    row: tuple[Any] | None = conn.execute(
        "SELECT spec -> %s::text FROM outbox_migrate.migration "
        "WHERE table_schema = %s AND table_name = %s AND state <> 'abandoned' "
        "ORDER BY id DESC LIMIT 1",
        (key, spec.schema, spec.table),
    ).fetchone()
    return row


def recorded_identity_generation(conn: Connection[Any], spec: OutboxSpec) -> str | None:
    row = _recorded(conn, spec, "identity_generation")
    return str(row[0]) if row and row[0] else None


def recorded_publications(
    conn: Connection[Any], spec: OutboxSpec
) -> tuple[PublicationFact, ...] | None:
    """The publications covering the old table as recorded when its migration started (None:
    no migration or no ledger yet), so the CDC step stays what it was when the migration
    started even if a publication changes later. A migration started by a release that did
    not record them has none: its steps stay the ones it started with."""
    if not ledger_exists(conn):
        return None
    row = _recorded(conn, spec, "publications")
    if row is None:
        return None
    if row[0] is None:
        return ()
    return tuple(
        PublicationFact(**{**item, "columns": tuple(item["columns"]) if item["columns"] else None})
        for item in row[0]
    )


def set_phase(conn: Connection[Any], migration_id: int, phase: str, state: str = "active") -> None:
    conn.execute(
        "UPDATE outbox_migrate.migration SET current_phase = %s, state = %s, "
        "updated_at = now() WHERE id = %s",
        (phase, state, migration_id),
    )


def discard_if_untouched(conn: Connection[Any], migration_id: int) -> bool:
    """Delete a migration record whose steps are all still `pending` and which owns no
    object — nothing of it was applied — with its step and attempt rows, in one transaction;
    False (and nothing changed) otherwise. For a command that started the record and then
    failed before applying anything: what it leaves is the ledger as it found it."""
    if conn.info.transaction_status is not TransactionStatus.IDLE:
        return False  # inside someone else's transaction, or the session is busy
    with conn.transaction():
        row = conn.execute(
            "SELECT NOT EXISTS (SELECT 1 FROM outbox_migrate.step WHERE migration_id = m.id "
            "                   AND state <> 'pending') "
            "   AND NOT EXISTS (SELECT 1 FROM outbox_migrate.owned_object "
            "                   WHERE migration_id = m.id) "
            "FROM outbox_migrate.migration m WHERE m.id = %s FOR UPDATE",
            (migration_id,),
        ).fetchone()
        if not (row and row[0]):
            return False
        for table in ("attempt", "step", "migration"):
            key = "id" if table == "migration" else "migration_id"
            conn.execute(
                sql.SQL("DELETE FROM {} WHERE {} = %s").format(
                    sql.Identifier(SCHEMA, table), sql.Identifier(key)
                ),
                (migration_id,),
            )
    return True


def abandon(conn: Connection[Any], migration_id: int) -> None:
    conn.execute(
        "UPDATE outbox_migrate.migration SET state = 'abandoned', updated_at = now() WHERE id = %s",
        (migration_id,),
    )


# -- the step state machine ------------------------------------------------------------

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
    """Move one step to `target`, stamping who, where and when. Call it inside the step's own
    transaction, so the state commits with the work.

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
    # The UPDATE matches only a row in a state the move is allowed from: an illegal move fails
    # loudly instead of rewriting history.
    if cursor.rowcount != 1:
        row = conn.execute(
            "SELECT state FROM outbox_migrate.step WHERE migration_id = %s AND step_id = %s",
            (migration_id, step_id),
        ).fetchone()
        found = row[0] if row else "no ledger row"
        raise IllegalTransition(f"{step_id}: {found} -> {target} is not a step transition")
