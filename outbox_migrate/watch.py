"""`status --watch`: one frame of what a migration is doing and waiting for, read live.

A frame adds to `status` what only the live server knows: whether a runner is at work on the
table (the session holding its advisory lock) and what it is doing; which sessions hold a lock
the next step needs, and for how long; which of the next step's checks fail right now (a gate's
"not yet": old-version sessions connected, ids still arriving, rows left unpublished); the
relay's backlog and the age of its oldest unpublished row; copy-back's and a running
VALIDATE's progress with rate and ETA.

Only reads, in autocommit sessions marked read-only, each query its own short transaction
(no snapshot held between frames) with a short statement_timeout: a watch must never be what
a migration waits for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate import marker_catalog
from outbox_migrate.config import OutboxSpec, Settings
from outbox_migrate.errors import SchemaError
from outbox_migrate.patterns import marker
from outbox_migrate.patterns.model import CheckPoint, LockMode, Step
from outbox_migrate.runner.session import runner_lock_key

WATCH_STATEMENT_TIMEOUT_MS = 2_000
"""A check slower than this is reported as such, not waited for: the frame must come."""
ASSUMED_SCAN_BYTES_PER_S = 200 * 1024 * 1024
"""VALIDATE reports no progress of its own: its ETA assumes this sequential read rate (the
figure `plan` estimates with), and says so."""


@dataclass(frozen=True)
class Holder:
    pid: int
    application: str
    state: str
    for_s: float | None
    mode: str
    relation: str


def _connect(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(
        dsn,
        autocommit=True,
        application_name="outbox-migrate status --watch",
        options=f"-c default_transaction_read_only=on "
        f"-c statement_timeout={WATCH_STATEMENT_TIMEOUT_MS}",
    )


def frame(dsn: str, settings: Settings, pattern: str | None) -> dict[str, Any]:
    """The status document plus `runner`, `next_step`, `holders`, `checks`, `relay`,
    `copy_back` and `validate` (each None or empty when there is nothing to show)."""
    from outbox_migrate.patterns import build_from_settings
    from outbox_migrate.runner import inspect

    document = inspect.status(dsn, settings, pattern)
    spec = settings.spec
    with _connect(dsn) as conn:
        document["runner"] = _runner_session(conn, inspect.table_label(settings))
        document["relay"] = _backlog(conn, spec)
        document["copy_back"] = _copy_back(conn)
        document["validate"] = _validate(conn, spec)
        document["next_step"] = None
        document["holders"] = []
        document["checks"] = []
        if not document["recorded"] or document["state"] != "active":
            return document
        built = build_from_settings(document["pattern"], settings)
        states = {s["id"]: s.get("state") for s in document["steps"]}
        step = next((s for s in built.steps() if states.get(s.id) != "done"), None)
        if step is None:
            return document
        document["next_step"] = {
            "id": step.id,
            "locks": [
                {"relation": lock.relation, "mode": lock.mode.sql_name} for lock in step.locks
            ],
        }
        document["holders"] = [vars(h) for h in holders(conn, step, spec.schema)]
        document["checks"] = failing_checks(conn, step)
    return document


def _runner_session(conn: psycopg.Connection[Any], label: str) -> dict[str, Any] | None:
    row = conn.execute(
        "SELECT a.pid, coalesce(a.application_name, ''), coalesce(a.state, ''), "
        "coalesce(a.wait_event_type, ''), extract(epoch FROM now() - a.state_change), "
        "left(regexp_replace(coalesce(a.query, ''), '\\s+', ' ', 'g'), 120), "
        "pg_blocking_pids(a.pid) "
        "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objid = %s AND l.granted",
        runner_lock_key(label),
    ).fetchone()
    if row is None:
        return None
    pid, app, state, wait, for_s, query, blocked_by = row
    return {
        "pid": int(pid),
        "application": str(app),
        "state": str(state),
        "waiting_for_lock": wait == "Lock",
        "for_s": round(float(for_s), 1) if for_s is not None else None,
        "query": str(query),
        "blocked_by": [int(p) for p in blocked_by or []],
    }


def holders(conn: psycopg.Connection[Any], step: Step, schema: str) -> list[Holder]:
    """Sessions holding a lock that conflicts with one the step needs: what it waits for.

    The runner does not queue behind them (it watches them go), so they are found from
    pg_locks' granted locks with the runner's own look (`lock_budget.find_blockers`)."""
    from outbox_migrate.lock_budget import find_blockers

    found = find_blockers(conn, [(lock.relation, lock.mode) for lock in step.locks], schema)
    return [
        Holder(b.pid, b.application_name, b.state,
               round(b.xact_age_s, 1) if b.xact_age_s is not None else None,
               LockMode(b.mode).sql_name, b.relation)
        for b in found
    ]  # fmt: skip


def failing_checks(conn: psycopg.Connection[Any], step: Step) -> list[dict[str, str]]:
    """The step's checks that fail now, with what they saw (a gate's "not yet").

    Checks that scan the table are left out (a watch must stay cheap); sampled ones are read
    once, which says "so far", not "over the window"."""
    failing: list[dict[str, str]] = []
    for condition in step.preconditions:
        if condition.at is CheckPoint.SCAN:
            continue
        try:
            rows = conn.execute(condition.query).fetchall()
        except psycopg.errors.QueryCanceled:
            failing.append({"check": condition.name, "observed": "too slow to watch"})
            continue
        except psycopg.Error as exc:
            failing.append({"check": condition.name, "observed": str(exc).splitlines()[0]})
            continue
        if rows:
            more = f" (+{len(rows) - 1} more)" if len(rows) > 1 else ""
            failing.append({"check": condition.name, "observed": f"{rows[0][0]}{more}"})
    return failing


def _backlog(conn: psycopg.Connection[Any], spec: OutboxSpec) -> list[dict[str, Any]]:
    """Unpublished rows and the oldest one's age, per outbox table that exists (the partial
    index on unpublished ids makes both cheap)."""
    out: list[dict[str, Any]] = []
    try:
        spec = marker_catalog.resolve(
            conn, spec, to_partition=False
        )  # a flag marker: its unpublished value
    except SchemaError as exc:
        return [{"table": spec.table, "error": str(exc)}]
    for table in dict.fromkeys((spec.table, spec.partitioned_table)):
        name = sql.Identifier(spec.schema, table)
        found = conn.execute("SELECT to_regclass(%s)", (name.as_string(conn),)).fetchone()
        if not found or found[0] is None:
            continue
        try:
            row = conn.execute(
                sql.SQL(
                    "SELECT count(*), extract(epoch FROM now() - min({created})) FROM {t} "
                    "WHERE {unpublished}"
                ).format(
                    t=name,
                    created=sql.Identifier(spec.created_column),
                    unpublished=marker.unpublished(spec),
                )
            ).fetchone()
        except psycopg.Error as exc:
            out.append({"table": table, "error": str(exc).splitlines()[0]})
            continue
        if row is not None:
            age = round(float(row[1]), 1) if row[1] is not None else None
            out.append({"table": table, "unpublished": int(row[0]), "oldest_s": age})
    return out


def _copy_back(conn: psycopg.Connection[Any]) -> dict[str, Any] | None:
    """Copy-back's progress from its progress table: rows, rate, ETA."""
    from outbox_migrate.jobs.common import STATE_SCHEMA
    from outbox_migrate.jobs.copy_back import PROGRESS_TABLE

    name = sql.Identifier(STATE_SCHEMA, PROGRESS_TABLE)
    found = conn.execute("SELECT to_regclass(%s)", (name.as_string(conn),)).fetchone()
    if not found or found[0] is None:
        return None
    row = conn.execute(
        sql.SQL(
            "SELECT rows_inserted + rows_present, total_rows, "
            "extract(epoch FROM updated_at - started_at), copied_at IS NOT NULL, "
            "dropped_at IS NOT NULL FROM {} ORDER BY updated_at DESC LIMIT 1"
        ).format(name)
    ).fetchone()
    if row is None:
        return None
    done, total, seconds, copied, dropped = row
    rate = float(done) / float(seconds) if seconds else None
    left = max(int(total or 0) - int(done), 0)
    return {
        "rows": int(done),
        "total": int(total) if total is not None else None,
        "rows_per_s": round(rate, 1) if rate else None,
        "eta_s": round(left / rate, 1) if rate and not copied else None,
        "state": "dropped" if dropped else "copied" if copied else "copying",
    }


def _validate(conn: psycopg.Connection[Any], spec: OutboxSpec) -> dict[str, Any] | None:
    """A VALIDATE CONSTRAINT running on the old table: for how long, and an estimated ETA."""
    row = conn.execute(
        "SELECT a.pid, extract(epoch FROM now() - a.query_start), "
        "pg_relation_size(to_regclass(%s)) FROM pg_stat_activity a "
        "WHERE a.state = 'active' AND a.query ILIKE '%%VALIDATE CONSTRAINT%%' "
        "AND a.pid <> pg_backend_pid() ORDER BY a.query_start LIMIT 1",
        (sql.Identifier(spec.schema, spec.table).as_string(conn),),
    ).fetchone()
    if row is None:
        return None
    pid, elapsed, size = row
    expected = float(size or 0) / ASSUMED_SCAN_BYTES_PER_S
    return {
        "pid": int(pid),
        "running_s": round(float(elapsed), 1),
        "expected_s": round(expected, 1),
        "fraction": min(float(elapsed) / expected, 0.99) if expected > 0 else None,
        "basis": f"heap size at an assumed {ASSUMED_SCAN_BYTES_PER_S // 2**20} MiB/s",
    }
