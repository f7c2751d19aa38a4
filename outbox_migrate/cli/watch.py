"""`status --watch`: what a migration is doing and waiting for, read live and shown every
`--interval` seconds (docs/cli.md, "Watch a migration live"). Only reads, and must never be
what a migration waits for."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.advisory.table_facts import ASSUMED_SCAN_BYTES_PER_S
from outbox_migrate.cli.signals import Terminated
from outbox_migrate.cli.wording import status_line
from outbox_migrate.config import OutboxSpec, Settings
from outbox_migrate.errors import SchemaError, first_of, shown_state
from outbox_migrate.jobs.common import backlog
from outbox_migrate.lock_budget import WATCH_APPLICATION_NAME, LockMode
from outbox_migrate.patterns import marker_catalog
from outbox_migrate.patterns.model import CheckPoint, Step
from outbox_migrate.runner.session import runner_lock_key

WATCH_READ_MS = 150
"""The longest a watch query may run (so hold a table's lock): the runner's lock_timeout is
200 ms by default, and a watch read must end well before an attempt behind it would time out."""
WATCH_LOCK_TIMEOUT_MS = 20
"""How long a watch query may wait for a lock: never long enough to stand in a step's queue."""
SWITCH_MARK_FRESH_S = 30.0
"""A switching relay's "waits" mark older than this is not shown (the relay stopped checking:
it switched, or that session no longer does the checks)."""


def read_budget_ms(settings: Settings) -> int:
    return max(10, min(WATCH_READ_MS, settings.lock_timeout_ms // 2))


def _connect(dsn: str, settings: Settings) -> psycopg.Connection[Any]:
    # Autocommit: each query its own short transaction, no snapshot held between frames. A
    # read's ACCESS SHARE queues a step's ACCESS EXCLUSIVE behind it, hence the timeouts.
    return psycopg.connect(
        dsn,
        autocommit=True,
        application_name=WATCH_APPLICATION_NAME,
        options=f"-c default_transaction_read_only=on "
        f"-c statement_timeout={read_budget_ms(settings)} "
        f"-c lock_timeout={WATCH_LOCK_TIMEOUT_MS}",
    )


def _unreadable(exc: psycopg.Error, settings: Settings | None) -> str:
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return "not read: a lock on it is held or requested by the migration (next frame)"
    if isinstance(exc, psycopg.errors.QueryCanceled):
        budget = read_budget_ms(settings or Settings())
        return f"too slow to read within {budget} ms (the watch holds no lock longer)"
    return str(exc).splitlines()[0]


def frame(dsn: str, settings: Settings, pattern: str | None) -> dict[str, Any]:
    """The status document plus `runner`, `switching_relays`, `next_step`, `holders`,
    `checks`, `relay`, `copy_back` and `validate` (each None or empty when there is nothing to
    show), and `skipped`: why the rest of the frame was not read, if it was not."""
    from outbox_migrate.runner import inspect

    document = inspect.status(dsn, settings, pattern)
    document.update(
        runner=None, switching_relays=[], relay=[], copy_back=None, validate=None,
        next_step=None, holders=[], checks=[], skipped=None,
    )  # fmt: skip
    with _connect(dsn, settings) as conn:
        try:
            _live(conn, document, settings)
        except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
            # A read this frame could not make without standing in a lock queue or holding
            # a lock too long: skip the rest of the frame, the next one tries again.
            document["skipped"] = _unreadable(exc, settings)
    return document


def _live(conn: psycopg.Connection[Any], document: dict[str, Any], settings: Settings) -> None:
    from outbox_migrate.patterns import build_from_settings
    from outbox_migrate.runner import inspect

    spec = settings.spec
    document["runner"] = _runner_session(conn, inspect.table_label(settings))
    document["switching_relays"] = switching_relays(conn)
    document["relay"] = _backlog(conn, spec, settings)
    document["copy_back"] = _copy_back(conn)
    document["validate"] = _validate(conn, spec)
    if not document["recorded"] or document["state"] != "active":
        return
    built = build_from_settings(document["pattern"], settings)
    states = {s["id"]: s.get("state") for s in document["steps"]}
    step = next((s for s in built.steps() if states.get(s.id) != "done"), None)
    if step is None:
        return
    document["next_step"] = {
        "id": step.id,
        "locks": [{"relation": lock.relation, "mode": lock.mode.sql_name} for lock in step.locks],
    }
    document["holders"] = holders(conn, step, spec.schema)
    document["checks"] = failing_checks(conn, step, settings)


def _runner_session(conn: psycopg.Connection[Any], label: str) -> dict[str, Any] | None:
    row = conn.execute(
        "SELECT a.pid, coalesce(a.application_name, ''), coalesce(a.state, ''), "
        "coalesce(a.wait_event_type, ''), extract(epoch FROM now() - a.state_change), "
        "left(regexp_replace(coalesce(a.query, ''), '\\s+', ' ', 'g'), 120), "
        "pg_blocking_pids(a.pid), CASE WHEN a.backend_type IS NULL THEN current_user END "
        "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objid = %s AND l.granted",
        runner_lock_key(label),
    ).fetchone()
    if row is None:
        return None
    pid, app, state, wait, for_s, query, blocked_by, hidden_from = row
    return {
        "pid": int(pid),
        "application": str(app),
        "state": shown_state(str(state), hidden_from or ""),
        "waiting_for_lock": wait == "Lock",
        "for_s": round(float(for_s), 1) if for_s is not None else None,
        "query": str(query),
        "blocked_by": [int(p) for p in blocked_by or []],
    }


def holders(conn: psycopg.Connection[Any], step: Step, schema: str) -> list[dict[str, Any]]:
    """Sessions holding a lock that conflicts with one the step needs, found with the runner's
    own look (`lock_budget.find_blockers`): the runner does not queue behind them."""
    from outbox_migrate.lock_budget import find_blockers

    found = find_blockers(conn, [(lock.relation, lock.mode) for lock in step.locks], schema)
    return [
        {"pid": b.pid, "application": b.application_name,
         "state": shown_state(b.state, b.hidden_from),
         "for_s": round(b.xact_age_s, 1) if b.xact_age_s is not None else None,
         "mode": LockMode(b.mode).sql_name, "relation": b.relation}
        for b in found
    ]  # fmt: skip


def failing_checks(
    conn: psycopg.Connection[Any], step: Step, settings: Settings
) -> list[dict[str, str]]:
    """The step's checks that fail now, with what they saw. Left out: scan checks, sampled ones
    (a window would hold the table's lock for seconds) and those that compare with their
    sample (only the runner's session has it)."""
    failing: list[dict[str, str]] = []
    sampled = {c.name for c in step.preconditions if c.at is CheckPoint.SAMPLED}
    for condition in step.preconditions:
        if condition.at in (CheckPoint.SCAN, CheckPoint.SAMPLED):
            continue
        if sampled and "since-sample" in condition.name:
            continue
        try:
            rows = conn.execute(condition.query).fetchall()
        except psycopg.Error as exc:
            failing.append({"check": condition.name, "observed": _unreadable(exc, settings)})
            continue
        if rows:
            observed = first_of([row[0] for row in rows])
            failing.append({"check": condition.name, "observed": observed})
    return failing


def _backlog(
    conn: psycopg.Connection[Any], spec: OutboxSpec, settings: Settings | None = None
) -> list[dict[str, Any]]:
    """Unpublished rows and the oldest one's age, per outbox table that exists (the partial
    index on unpublished ids makes both cheap)."""
    out: list[dict[str, Any]] = []
    try:
        spec = marker_catalog.resolve(
            conn, spec, to_partition=False
        )  # a flag marker: its unpublished value
    except SchemaError as exc:
        return [{"table": spec.table, "error": str(exc)}]
    except psycopg.Error as exc:  # deparsing the column's DEFAULT locks the table
        return [{"table": spec.table, "error": _unreadable(exc, settings)}]
    for table in dict.fromkeys((spec.table, spec.partitioned_table)):
        try:
            found = backlog(conn, spec, table)
        except psycopg.Error as exc:
            out.append({"table": table, "error": _unreadable(exc, settings)})
            continue
        if found is not None:
            age = round(found[1], 1) if found[1] is not None else None
            out.append({"table": table, "unpublished": found[0], "oldest_s": age})
    return out


def _copy_back(conn: psycopg.Connection[Any]) -> dict[str, Any] | None:
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
    # The size from the catalog (relpages): pg_relation_size would lock the table.
    row = conn.execute(
        "SELECT a.pid, extract(epoch FROM now() - a.query_start), "
        "(SELECT c.relpages::bigint * current_setting('block_size')::bigint FROM pg_class c "
        " WHERE c.oid = to_regclass(%s)) FROM pg_stat_activity a "
        "WHERE a.state = 'active' AND a.query ILIKE '%%VALIDATE CONSTRAINT%%' "
        "AND a.pid <> pg_backend_pid() ORDER BY a.query_start LIMIT 1",
        (sql.Identifier(spec.schema, spec.table).as_string(conn),),
    ).fetchone()
    if row is None:
        return None
    pid, elapsed, size = row
    # VALIDATE reports no progress of its own: its ETA assumes the read rate `plan` uses.
    expected = float(size or 0) / ASSUMED_SCAN_BYTES_PER_S
    return {
        "pid": int(pid),
        "running_s": round(float(elapsed), 1),
        "expected_s": round(expected, 1),
        "fraction": min(float(elapsed) / expected, 0.99) if expected > 0 else None,
        "basis": f"heap size at an assumed {ASSUMED_SCAN_BYTES_PER_S // 2**20} MiB/s",
    }


def switching_relays(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """Switching relays whose last switch check said "not yet", with its short reason and
    how long ago (relay/switching.py `mark_waiting`); application_name is visible to every
    role, unlike the session's state."""
    from outbox_migrate.relay.switching import SWITCH_WAITS

    rows = conn.execute(
        "SELECT a.pid, split_part(a.application_name, %(m)s, 2) FROM pg_stat_activity a "
        "WHERE a.datname = current_database() AND a.application_name LIKE %(like)s "
        "ORDER BY a.pid",
        {"m": SWITCH_WAITS, "like": "outbox-migrate/%" + SWITCH_WAITS + "%"},
    ).fetchall()
    now = time.time()
    found: list[dict[str, Any]] = []
    for pid, mark in rows:
        code, _, stamp = str(mark).partition(" @")
        age = now - int(stamp) if stamp.isdigit() else None
        if age is None or age > SWITCH_MARK_FRESH_S:
            continue
        found.append(
            {"pid": int(pid), "waits": code, "why": SWITCH_WAIT_REASONS.get(code, code),
             "seen_s_ago": round(max(age, 0.0), 1)}
        )  # fmt: skip
    return found


SWITCH_WAIT_REASONS = {
    "privilege": "a login role still holds INSERT on the flat table: once the old version is "
    "gone, REVOKE it as the table's owner (the relay's log names the roles)",
    "bypass": "sessions of superusers or of the table's owner are connected; a REVOKE does "
    "not stop them (give the relay --old-app-name, or disconnect them)",
    "bypass+old": "sessions of superusers or of the owner are connected, and sessions of the "
    "old version",
    "bypass+quiet": "sessions of superusers or of the owner are connected; waiting for the flat "
    "table's insert counter to stand still",
    "old-sessions": "sessions of the old version (--old-app-name) are still connected",
    "unpublished": "rows of the flat table remain unpublished",
    "writing": "a transaction is still writing the flat table",
}
"""What each of the relay's short codes means (relay/switching.py WAIT_CODES)."""


CLEAR = "\x1b[H\x1b[2J"
BAR_WIDTH = 20


def _bar(fraction: float) -> str:
    filled = round(max(0.0, min(fraction, 1.0)) * BAR_WIDTH)
    return "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + f"] {fraction:4.0%}"


def _age(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:,.1f} s"


def _runner_lines(doc: dict[str, Any]) -> list[str]:
    runner = doc.get("runner")
    if runner is None:
        return ["runner: none at work on this table"]
    state = runner["state"] or "?"
    line = f"runner: pid {runner['pid']} ({runner['application'] or 'no name'}), {state}"
    line += f" for {_age(runner['for_s'])}"
    if runner["waiting_for_lock"]:
        line += f", waiting for a lock held by pid {', '.join(map(str, runner['blocked_by']))}"
    return [line]


def _step_lines(doc: dict[str, Any]) -> list[str]:
    step = doc.get("next_step")
    if step is None:
        return []
    lines = [f"next step: {step['id']}"]
    lines += [f"  needs {lock['mode']} on {lock['relation']}" for lock in step["locks"]]
    lines += [
        f"  blocked by pid {h['pid']} ({h['application'] or 'no name'}, {h['state'] or '?'}, "
        f"for {_age(h['for_s'])}) holding {h['mode']} on {h['relation']}"
        for h in doc.get("holders", [])
    ]
    if doc.get("checks"):
        lines.append("  not yet:")
        lines += [f"    {c['check']}: {c['observed']}" for c in doc["checks"]]
    return lines


def _switch_lines(doc: dict[str, Any]) -> list[str]:
    skipped = [f"rest of this frame skipped: {doc['skipped']}"] if doc.get("skipped") else []
    return skipped + [
        f"switching relay pid {r['pid']} waits ({r['seen_s_ago']:g} s ago): {r['why']}"
        for r in doc.get("switching_relays") or []
    ]


def _job_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    for table in doc.get("relay") or []:
        if "error" in table:
            lines.append(f"backlog of {table['table']}: unreadable ({table['error']})")
        else:
            oldest = f", oldest {_age(table['oldest_s'])}" if table["oldest_s"] is not None else ""
            lines.append(
                f"backlog of {table['table']}: {table['unpublished']:,} unpublished{oldest}"
            )
    copy = doc.get("copy_back")
    if copy is not None:
        total = copy["total"]
        done = f"{copy['rows']:,}" + (f"/{total:,}" if total else "") + " rows"
        bar = _bar(copy["rows"] / total) + " " if total else ""
        rate = f", {copy['rows_per_s']:,} rows/s" if copy["rows_per_s"] else ""
        eta = f", ETA {_age(copy['eta_s'])}" if copy["eta_s"] is not None else ""
        lines.append(f"copy-back ({copy['state']}): {bar}{done}{rate}{eta}")
    validate = doc.get("validate")
    if validate is not None:
        bar = _bar(validate["fraction"]) + " " if validate["fraction"] is not None else ""
        lines.append(
            f"VALIDATE (pid {validate['pid']}): {bar}{_age(validate['running_s'])} of "
            f"~{_age(validate['expected_s'])} ({validate['basis']})"
        )
    return lines


def render(doc: dict[str, Any], width: int, now: float | None = None) -> list[str]:
    """One frame as lines no wider than `width`; step ids are never cut (an id longer than
    the width stands alone on its line)."""
    clock = time.strftime("%H:%M:%S", time.localtime(now))
    head = status_line(doc) if doc["recorded"] else f"no migration recorded for {doc['table']}"
    raw = [
        f"{clock}  {head}",
        *_runner_lines(doc),
        *_step_lines(doc),
        *_switch_lines(doc),
        *_job_lines(doc),
    ]
    if doc["steps"]:
        widest = max(len(s["id"]) for s in doc["steps"])
        raw.append("steps:")
        raw += [f"  {s['id']:<{widest}}  {s.get('state', 'pending')}" for s in doc["steps"]]
    lines: list[str] = []
    for line in raw:
        lead = " " * (len(line) - len(line.lstrip()))
        lines += textwrap.wrap(
            line.lstrip(), width, initial_indent=lead, subsequent_indent=lead + "  ",
            break_long_words=False, break_on_hyphens=False,
        ) or [""]  # fmt: skip
    return lines


def watch(
    get_frame: Callable[[], dict[str, Any]],
    *,
    interval_s: float,
    count: int | None,
    json_lines: bool = False,
) -> None:
    """Print frames until Ctrl-C or until `count` frames were shown; with `json_lines`, one
    JSON document per frame and line. Ctrl-C is how a watch is left, not an error: it returns
    normally (exit 0). SIGTERM still ends it as the CLI's termination."""
    # A Ctrl-C mid-query leaves psycopg unable to roll back the read-only session as it
    # closes, which it reports at WARNING; for a watch that is the normal way out.
    quiet = logging.getLogger("psycopg")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        terminal = sys.stdout.isatty() and not json_lines
        shown = 0
        while count is None or shown < count:
            started = time.monotonic()
            document = get_frame()
            if json_lines:
                sys.stdout.write(json.dumps(document, default=str) + "\n")
            else:
                lines = render(document, shutil.get_terminal_size((80, 24)).columns)
                lead = CLEAR if terminal else ("\n" if shown else "")
                sys.stdout.write(lead + "\n".join(lines) + "\n")
            sys.stdout.flush()
            shown += 1
            if count is not None and shown >= count:
                break
            time.sleep(max(interval_s - (time.monotonic() - started), 0.0))
    except KeyboardInterrupt as exc:
        if isinstance(exc, Terminated):
            raise
        sys.stdout.write("\n")
        sys.stdout.flush()
    finally:
        quiet.setLevel(level)
