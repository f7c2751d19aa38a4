"""Retention for the published partition: delete rows published before a cutoff in block-range
batches, gently. It must not touch a table that HOPER's copy-back is still filling.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.jobs import common
from outbox_migrate.jobs.common import Relation
from outbox_migrate.jobs.throttle import pause, rate_pause_s
from outbox_migrate.patterns import marker

DEFAULT_BATCH_BLOCKS = 1_000
"""Heap blocks per delete batch (8 MB with 8 kB blocks)."""
DEFAULT_MAX_ROWS_PER_S = 50_000.0
"""Ceiling on deleted rows per second."""


@dataclass(frozen=True)
class RetentionResult:
    table: str
    cutoff_age_s: float
    deleted_rows: int
    batches: int
    seconds: float
    skipped: str | None = None
    denied: bool = False
    """`skipped` (or stopped) for want of a privilege: a problem (exit 5), not a wait."""


def copy_back_pending(conn: psycopg.Connection[Any], table: Relation) -> bool:
    progress = Relation(common.STATE_SCHEMA, "copy_back_progress")
    if not common.exists(conn, progress):
        return False
    row = conn.execute(
        sql.SQL(
            "SELECT 1 FROM {} WHERE target_schema = %s AND target_table = %s AND dropped_at IS NULL"
        ).format(progress.ident),
        (table.schema, table.name),
    ).fetchone()
    return row is not None


def age_column(spec: OutboxSpec) -> str:
    """The column retention measures age by: the publication time, or for a flag marker
    (which records no time) the creation time ("" when the outbox has none)."""
    return spec.created_column if marker.of(spec).is_flag else spec.published_column


def delete_published_before(
    conn: psycopg.Connection[Any],
    table: Relation,
    published_column: str,
    older_than: timedelta,
    *,
    batch_blocks: int = DEFAULT_BATCH_BLOCKS,
    max_rows_per_s: float = DEFAULT_MAX_ROWS_PER_S,
    stop: threading.Event | None = None,
) -> RetentionResult:
    age_s = older_than.total_seconds()
    if copy_back_pending(conn, table):
        pending = "HOPER copy-back into this table is not finished"
        return RetentionResult(str(table), age_s, 0, 0, 0.0, skipped=pending)
    oid = common.oid_of(conn, table)
    if oid is None:
        return RetentionResult(str(table), age_s, 0, 0, 0.0, skipped="table does not exist")
    unusable = _not_a_time(conn, oid, published_column)
    if unusable:
        return RetentionResult(str(table), age_s, 0, 0, 0.0, skipped=unusable)
    lacking = _lacking(conn, oid, published_column)
    if lacking:
        return RetentionResult(str(table), age_s, 0, 0, 0.0, skipped=_denied(conn, table, lacking),
                               denied=True)  # fmt: skip
    row = conn.execute(
        "SELECT pg_relation_size(%s::oid) / current_setting('block_size')::int8,"
        " now() - make_interval(secs => %s)",
        (oid, age_s),
    ).fetchone()
    assert row is not None
    blocks, cutoff = int(row[0]), row[1]
    statement = sql.SQL(
        "DELETE FROM {t} WHERE ctid >= %(lo)s::tid AND ctid < %(hi)s::tid AND {pub} < %(cutoff)s"
    ).format(t=table.ident, pub=sql.Identifier(published_column))
    started = time.monotonic()
    deleted = batches = 0
    # Blocks past the size measured at the start hold rows newer than the cutoff (appended
    # since), so one pass over [0, blocks) is complete for this cutoff.
    for low in range(0, blocks, batch_blocks):
        if stop is not None and stop.is_set():
            break
        bounds = {"lo": f"({low},0)", "hi": f"({low + batch_blocks},0)", "cutoff": cutoff}
        try:
            cur = conn.execute(statement, bounds)
        except psycopg.errors.InsufficientPrivilege as exc:  # revoked meanwhile, or a policy
            stopped = f"stopped: {str(exc).strip().splitlines()[0]}; " + _denied(conn, table, "")
            return RetentionResult(str(table), age_s, deleted, batches,
                                   time.monotonic() - started, skipped=stopped,
                                   denied=True)  # fmt: skip
        deleted += cur.rowcount
        batches += 1
        pause(rate_pause_s(deleted, time.monotonic() - started, max_rows_per_s), stop)
    return RetentionResult(str(table), age_s, deleted, batches, time.monotonic() - started)


def _not_a_time(conn: psycopg.Connection[Any], oid: int, column: str) -> str:
    """Why `column` cannot measure age ("" when it can): a flag marker records no publication
    time, and its outbox's creation column may be missing or not a timestamp (epoch
    milliseconds in a bigint)."""
    if not column:
        return "the publication marker is a flag and created_column is unset: no age to measure"
    row = conn.execute(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = %s AND attname = %s AND NOT attisdropped",
        (oid, column),
    ).fetchone()
    if row is None or not str(row[0]).startswith("timestamp"):
        shown = "missing" if row is None else str(row[0])
        return f"column {column} ({shown}) is not a timestamp: no age to measure"
    return ""


def _lacking(conn: psycopg.Connection[Any], oid: int, column: str) -> str:
    """The privileges the batched DELETE needs and this role lacks ("" when none): DELETE on
    the table and SELECT on the column its WHERE reads."""
    row = conn.execute(
        "SELECT has_table_privilege(%s::oid, 'DELETE'), "
        "has_column_privilege(%s::oid, %s, 'SELECT')",
        (oid, oid, column),
    ).fetchone()
    assert row is not None
    names = [name for name, held in zip(("DELETE", f"SELECT ({column})"), row, strict=True)
             if not held]  # fmt: skip
    return " and ".join(names)


def _denied(conn: psycopg.Connection[Any], table: Relation, lacking: str) -> str:
    """Why retention did not run, with the grant that lets it."""
    role = sql.Identifier(conn.info.user).as_string(conn)
    grant = f"GRANT SELECT, DELETE ON {table.ident.as_string(conn)} TO {role}"
    if not lacking:
        return f"role {conn.info.user} needs {grant}"
    return f"not applied: role {conn.info.user} lacks {lacking} on it ({grant})"
