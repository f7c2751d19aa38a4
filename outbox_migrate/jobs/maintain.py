"""Outbox maintenance, one pass at a time: autovacuum settings, index bloat, REINDEX, retention
(docs/maintenance.md). A pass returns a report; it never prints.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import psycopg
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.db import connect, lock_timeout, one_line
from outbox_migrate.errors import (
    LockBudgetExceeded,
    OutboxMigrateError,
    ReindexFailed,
    ReindexRefused,
    UsageError,
)
from outbox_migrate.jobs import bloat, common, reindex, retention, time_partitions
from outbox_migrate.jobs.common import Relation
from outbox_migrate.jobs.reindex import DEFAULT_MAX_XACT_AGE_S, DEFAULT_REINDEX_LOCK_TIMEOUT_MS
from outbox_migrate.jobs.retention import DEFAULT_BATCH_BLOCKS, DEFAULT_MAX_ROWS_PER_S
from outbox_migrate.lock_budget import LockBudget, run_with_lock_budget
from outbox_migrate.patterns import marker, marker_catalog

DEFAULT_BLOAT_THRESHOLD_PCT = 50.0
"""Rebuild the unpublished index once more than this share of it is bloat."""
DEFAULT_MIN_INDEX_BYTES = 1024 * 1024
"""Indexes smaller than this are never worth a rebuild, whatever their bloat."""
DEFAULT_INTERVAL_S = 300.0
"""Time between passes in loop mode."""
VACUUM_LOCK_TIMEOUT_MS = 5_000


# -- autovacuum settings of the published partition (docs/maintenance.md, section 1) --------

DEFAULT_EVERY_ROWS = 100_000
"""Vacuum and analyze the published partition every this many inserted rows (the spec's)."""
AUTOVACUUM_LOCK_TIMEOUT_MS = 1_000


def published_settings(every_rows: int = DEFAULT_EVERY_ROWS) -> dict[str, str]:
    """The spec's insert-only settings: fixed thresholds, no scale factor."""
    return {
        "autovacuum_vacuum_insert_scale_factor": "0",
        "autovacuum_vacuum_insert_threshold": str(every_rows),
        "autovacuum_analyze_scale_factor": "0",
        "autovacuum_analyze_threshold": str(every_rows),
    }


@dataclass(frozen=True)
class AutovacuumCheck:
    table: str
    expected: dict[str, str]
    actual: dict[str, str]
    applied: bool
    """True when this run changed the settings."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return all(_same(self.actual.get(k), v) for k, v in self.expected.items())


def _same(actual: str | None, expected: str) -> bool:
    if actual is None:
        return False
    try:
        return float(actual) == float(expected)
    except ValueError:
        return actual == expected


def autovacuum_settings(conn: psycopg.Connection[Any], table: Relation) -> dict[str, str]:
    row = conn.execute(
        "SELECT c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s",
        (table.schema, table.name),
    ).fetchone()
    options = (row[0] if row else None) or []
    return dict(str(o).split("=", 1) for o in options)


def ensure_autovacuum(
    conn: psycopg.Connection[Any], table: Relation, expected: dict[str, str], *, apply: bool
) -> AutovacuumCheck:
    """Check `table`'s settings; with `apply`, set the ones that differ and check again."""
    actual = autovacuum_settings(conn, table)
    check = AutovacuumCheck(str(table), expected, actual, applied=False)
    if check.ok or not apply:
        return check
    assignments = sql.SQL(", ").join(
        sql.SQL("{} = {}").format(sql.Identifier(k), sql.Literal(v)) for k, v in expected.items()
    )
    statement = sql.SQL("ALTER TABLE {} SET ({})").format(table.ident, assignments)
    if not _owns(conn, table):
        # Storage parameters are the owner's to set (MAINTAIN does not cover them).
        denied = (f"role {conn.info.user} does not own it: run maintain as its owner, or "
                  "--no-autovacuum to only check")  # fmt: skip
        return AutovacuumCheck(str(table), expected, actual, applied=False, error=denied)
    try:
        # One attempt (budget 0): a vacuum holding the table is normal; the next run retries.
        run_with_lock_budget(
            conn, "autovacuum-settings",
            LockBudget(lock_timeout_ms=AUTOVACUUM_LOCK_TIMEOUT_MS, budget_s=0.0),
            lambda c: c.execute(statement), relations=(), schema=table.schema,
            watch_blockers=False,
        )  # fmt: skip
    except LockBudgetExceeded:
        busy = "table busy (a vacuum holds its lock); retried next run"
        return AutovacuumCheck(str(table), expected, actual, applied=False, error=busy)
    return AutovacuumCheck(str(table), expected, autovacuum_settings(conn, table), applied=True)


@dataclass(frozen=True)
class MaintenanceOptions:
    apply_autovacuum: bool = True
    published_every_rows: int = DEFAULT_EVERY_ROWS
    bloat_threshold_pct: float = DEFAULT_BLOAT_THRESHOLD_PCT
    bloat_method: Literal["auto", "pgstattuple", "estimate"] = "auto"
    min_index_bytes: int = DEFAULT_MIN_INDEX_BYTES
    vacuum_unpublished: bool = True
    reindex: bool = True
    max_xact_age_s: float = DEFAULT_MAX_XACT_AGE_S
    reindex_lock_timeout_ms: int = DEFAULT_REINDEX_LOCK_TIMEOUT_MS
    retention: timedelta | None = None
    retention_batch_blocks: int = DEFAULT_BATCH_BLOCKS
    retention_max_rows_per_s: float = DEFAULT_MAX_ROWS_PER_S
    partition_interval: time_partitions.Interval = "month"
    """Period of new sub-partitions when the published partition is RANGE-partitioned."""
    partitions_ahead: int = 2
    """Periods after the current one kept created ahead."""


IndexStatus = Literal["ok", "reindexed", "refused", "failed", "small", "untrusted", "skipped"]


@dataclass(frozen=True)
class IndexOutcome:
    index: str
    status: IndexStatus
    before: bloat.IndexBloat
    after: bloat.IndexBloat | None = None
    seconds: float = 0.0
    message: str = ""
    window: tuple[float, float] | None = None
    """`time.monotonic()` at the start and end of the REINDEX (to line up other measurements)."""


@dataclass
class MaintenanceReport:
    started_at: str
    unpublished: str
    published: str | None
    autovacuum: list[AutovacuumCheck] = field(default_factory=list)
    """One check per leaf table of the published partition."""
    vacuumed: bool = False
    """True only when the VACUUM ran: PostgreSQL skips one the role may not run with a
    WARNING, not an error, and that is reported in `denied`."""
    indexes: list[IndexOutcome] = field(default_factory=list)
    retention: retention.RetentionResult | None = None
    time_partitions: time_partitions.TimePartitionResult | None = None
    notes: list[str] = field(default_factory=list)
    denied: list[str] = field(default_factory=list)
    """What the pass could not do for want of a privilege, each naming it (exit 5)."""
    seconds: float = 0.0

    @property
    def problems(self) -> list[str]:
        """What an operator (or a CronJob's exit code) should hear about."""
        found = list(self.denied)
        found += [o.message for o in self.indexes if o.status in ("refused", "failed")]
        for check in self.autovacuum:
            if not check.ok:
                found.append(
                    f"autovacuum settings of {check.table} differ from the spec's"
                    + (f": {check.error}" if check.error else "")
                )
        if self.retention is not None and self.retention.denied:
            found.append(f"retention on {self.retention.table}: {self.retention.skipped}")
        if self.time_partitions is not None and self.time_partitions.busy:
            found.append(
                "could not get the lock to attach/detach "
                + ", ".join(self.time_partitions.busy)
                + " (retried next pass)"
            )
        return found


@dataclass(frozen=True)
class Partitions:
    unpublished: Relation
    published: Relation | None


def find_partitions(conn: psycopg.Connection[Any], spec: OutboxSpec) -> Partitions:
    """The NULL partition and the DEFAULT partition of the partitioned outbox, by catalog."""
    rows = conn.execute(
        "SELECT cn.nspname, c.relname, pg_get_expr(c.relpartbound, c.oid),"
        " c.oid = pt.partdefid"
        " FROM pg_class p JOIN pg_namespace pn ON pn.oid = p.relnamespace"
        " JOIN pg_partitioned_table pt ON pt.partrelid = p.oid"
        " JOIN pg_inherits i ON i.inhparent = p.oid JOIN pg_class c ON c.oid = i.inhrelid"
        " JOIN pg_namespace cn ON cn.oid = c.relnamespace"
        " WHERE pn.nspname = %s AND p.relname = %s",
        (spec.schema, spec.partitioned_table),
    ).fetchall()
    unpublished = published = None
    for schema, name, bound, is_default in rows:
        if is_default:
            published = Relation(str(schema), str(name))
        elif _unpublished_bound(str(bound), spec):
            unpublished = Relation(str(schema), str(name))
    if unpublished is None:
        raise UsageError(
            f"{spec.schema}.{spec.partitioned_table} has no {marker.bound_text(spec)} partition "
            "(is it the partitioned outbox, and is it created yet?)"
        )
    return Partitions(unpublished, published)


def _unpublished_bound(bound: str, spec: OutboxSpec) -> bool:
    """The unpublished partition's bound, `FOR VALUES IN (NULL)` or a flag's value (the
    catalog quotes `'0'` by type: compared without quotes or spaces)."""

    def bare(text: str) -> str:
        return text.replace(" ", "").replace("'", "").upper()

    return bare(bound) == bare(marker.bound_text(spec))


def _btree_indexes(conn: psycopg.Connection[Any], table: Relation) -> list[tuple[int, str]]:
    rows = conn.execute(
        "SELECT ic.oid::int8, ic.relname FROM pg_index i"
        " JOIN pg_class ic ON ic.oid = i.indexrelid JOIN pg_am am ON am.oid = ic.relam"
        " JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s AND i.indisvalid AND am.amname = 'btree'"
        " ORDER BY ic.relname",
        (table.schema, table.name),
    ).fetchall()
    return [(int(r[0]), str(r[1])) for r in rows]


VacuumOutcome = Literal["vacuumed", "busy", "denied"]

VACUUM_DENIED = (
    "PostgreSQL skips the VACUUM of a table the role may not vacuum: only its owner or the "
    "database's may (from PostgreSQL 17 also a role with MAINTAIN on it, or pg_maintain); run "
    "maintain as the owner"
)


def _owns(conn: psycopg.Connection[Any], table: Relation) -> bool:
    """Whether this role has the privileges of `table`'s owner (a superuser has)."""
    row = conn.execute(
        "SELECT pg_has_role(c.relowner, 'USAGE') FROM pg_class c WHERE c.oid = %s",
        (common.oid_of(conn, table),),
    ).fetchone()
    return bool(row and row[0])


def may_vacuum(conn: psycopg.Connection[Any], table: Relation) -> bool:
    """The server's own rule for VACUUM and ANALYZE: the owner of the table or of the
    database, and from PostgreSQL 17 the MAINTAIN privilege (which pg_maintain holds)."""
    maintain = "has_table_privilege(c.oid, 'MAINTAIN')"
    owner = maintain if conn.info.server_version >= 170000 else "pg_has_role(c.relowner, 'USAGE')"
    row = conn.execute(
        sql.SQL(
            "SELECT {} OR (SELECT pg_has_role(d.datdba, 'USAGE') FROM pg_database d "
            "WHERE d.datname = current_database()) FROM pg_class c WHERE c.oid = %s"
        ).format(sql.SQL(owner)),  # one of two constant expressions above
        (common.oid_of(conn, table),),
    ).fetchone()
    return bool(row and row[0])


def vacuum_analyze(conn: psycopg.Connection[Any], table: Relation) -> VacuumOutcome:
    """VACUUM (ANALYZE) under a lock_timeout: "busy" when another vacuum holds the table,
    "denied" when the role may not vacuum it. PostgreSQL answers that with a WARNING and
    skips the table, so it is checked first, and a privilege WARNING met anyway (SQLSTATE
    42501 from PostgreSQL 16) counts as denied too: never reported as vacuumed."""
    if not may_vacuum(conn, table):
        return "denied"
    warned: list[str] = []

    def on_notice(diagnostic: psycopg.errors.Diagnostic) -> None:
        if diagnostic.sqlstate == "42501":
            warned.append(diagnostic.message_primary or "")

    conn.add_notice_handler(on_notice)
    try:
        with lock_timeout(conn, VACUUM_LOCK_TIMEOUT_MS):
            # TRUNCATE false: truncating the empty tail needs ACCESS EXCLUSIVE on the busiest
            # table of the outbox (and is replayed as such on replicas); vacuum would also
            # spend up to 5 s retrying for it while any transaction holds the table.
            # Autovacuum still may.
            conn.execute(sql.SQL("VACUUM (ANALYZE, TRUNCATE false) {}").format(table.ident))
    except psycopg.errors.LockNotAvailable:
        return "busy"
    finally:
        conn.remove_notice_handler(on_notice)
    return "denied" if warned else "vacuumed"


def _verdict(
    name: str, before: bloat.IndexBloat, options: MaintenanceOptions
) -> tuple[IndexStatus, str] | None:
    """Why an index is left alone this pass; None when it should be rebuilt."""
    if before.bloat_pct <= options.bloat_threshold_pct:
        return "ok", ""
    if before.size_bytes < options.min_index_bytes:
        return "small", f"{name} is below the minimum size for a rebuild"
    if not before.trustworthy:
        return "untrusted", f"{name}: no statistics to trust the estimate; not rebuilt"
    if not options.reindex:
        return "skipped", f"{name} needs a rebuild ({before.bloat_pct:.0f} % bloat); reindex off"
    return None


def _maintain_index(
    conn: psycopg.Connection[Any],
    table: Relation,
    oid: int,
    name: str,
    options: MaintenanceOptions,
) -> IndexOutcome:
    before = bloat.measure(conn, oid, options.bloat_method)
    verdict = _verdict(name, before, options)
    if verdict is not None:
        return IndexOutcome(name, verdict[0], before, message=verdict[1])
    try:
        done = reindex.reindex_concurrently(
            conn,
            table,
            name,
            max_xact_age_s=options.max_xact_age_s,
            lock_timeout_ms=options.reindex_lock_timeout_ms,
        )
    except ReindexRefused as exc:
        return IndexOutcome(name, "refused", before, message=str(exc))
    except ReindexFailed as exc:
        return IndexOutcome(name, "failed", before, message=str(exc))
    new_oid = next((i for i, index in _btree_indexes(conn, table) if index == name), None)
    after = bloat.measure(conn, new_oid, options.bloat_method) if new_oid else None
    return IndexOutcome(name, "reindexed", before, after, done.seconds, window=done.window)


def _leaves(conn: psycopg.Connection[Any], table: Relation) -> list[Relation]:
    rows = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_partition_tree(%s::oid) t"
        " JOIN pg_class c ON c.oid = t.relid JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE t.isleaf ORDER BY c.relname",
        (common.oid_of(conn, table),),
    ).fetchall()
    return [Relation(str(r[0]), str(r[1])) for r in rows]


def _time_partitions(
    conn: psycopg.Connection[Any],
    spec: OutboxSpec,
    published: Relation,
    options: MaintenanceOptions,
    report: MaintenanceReport,
) -> None:
    """Retention by partition drop when the published partition is RANGE-partitioned on the
    publication time; nothing to do (batched deletes apply) otherwise."""
    if time_partitions.range_key(conn, published) != spec.published_column:
        return
    result = time_partitions.TimePartitionResult(str(published))
    time_partitions.ensure_ahead(
        conn, published, spec.published_column,
        interval=options.partition_interval, ahead=options.partitions_ahead, result=result,
    )  # fmt: skip
    if options.retention is not None:
        if retention.copy_back_pending(conn, published):
            report.notes.append("retention skipped: HOPER copy-back into it is not finished")
        else:
            time_partitions.drop_expired(conn, published, options.retention, result=result)
    report.time_partitions = result


def maintain_once(
    conn: psycopg.Connection[Any],
    spec: OutboxSpec,
    options: MaintenanceOptions | None = None,
    *,
    stop: threading.Event | None = None,
) -> MaintenanceReport:
    """One maintenance pass. `conn` must be autocommit (VACUUM and REINDEX CONCURRENTLY)."""
    options = options or MaintenanceOptions()
    if not conn.autocommit:
        raise UsageError("maintenance needs an autocommit connection")
    started = time.monotonic()
    spec = marker_catalog.resolve(conn, spec, to_partition=False)  # a flag marker's values
    parts = find_partitions(conn, spec)
    report = MaintenanceReport(
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        unpublished=str(parts.unpublished),
        published=str(parts.published) if parts.published else None,
    )
    if parts.published is not None:
        # Time sub-partitions first, so a sub-partition created now gets its settings below.
        _time_partitions(conn, spec, parts.published, options, report)
        expected = published_settings(options.published_every_rows)
        # Storage parameters live on leaf tables: a sub-partitioned published partition
        # gets them on every sub-partition.
        report.autovacuum = [
            ensure_autovacuum(conn, leaf, expected, apply=options.apply_autovacuum)
            for leaf in _leaves(conn, parts.published)
        ]
    else:
        report.notes.append("no DEFAULT (published) partition attached: autovacuum skipped")
    if options.vacuum_unpublished:
        outcome = vacuum_analyze(conn, parts.unpublished)
        report.vacuumed = outcome == "vacuumed"
        if outcome == "busy":
            report.notes.append(f"{parts.unpublished} was busy; measured without a fresh vacuum")
        elif outcome == "denied":
            report.denied.append(
                f"{parts.unpublished} not vacuumed: role {conn.info.user} may not vacuum it "
                f"({VACUUM_DENIED}); its bloat is measured on the statistics of its last vacuum"
            )
    # One index at a time: two concurrent rebuilds on one table would wait on each other.
    for oid, name in _btree_indexes(conn, parts.unpublished):
        if stop is not None and stop.is_set():
            break
        report.indexes.append(_maintain_index(conn, parts.unpublished, oid, name, options))
    if (
        options.retention is not None
        and parts.published is not None
        and report.time_partitions is None
    ):
        report.retention = retention.delete_published_before(
            conn,
            parts.published,
            retention.age_column(spec),
            options.retention,
            batch_blocks=options.retention_batch_blocks,
            max_rows_per_s=options.retention_max_rows_per_s,
            stop=stop,
        )
    report.seconds = round(time.monotonic() - started, 3)
    return report


def maintain_loop(
    dsn: str,
    spec: OutboxSpec,
    options: MaintenanceOptions,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    on_report: Callable[[MaintenanceReport], None],
    on_error: Callable[[OutboxMigrateError], None],
    stop: threading.Event,
) -> None:
    """Run a pass every `interval_s` until `stop` is set. A failed pass (the database is
    down, a table is missing) is reported and retried next interval, not fatal."""
    while not stop.is_set():
        try:
            with connect(dsn) as conn:
                on_report(maintain_once(conn, spec, options, stop=stop))
        except OutboxMigrateError as exc:
            on_error(exc)
        except psycopg.Error as exc:
            on_error(UsageError(f"maintenance pass failed: {one_line(str(exc), dsn)}"))
        stop.wait(interval_s)
