"""Read-only catalog look-ups and session helpers shared by the jobs; each job decides on its
own what to change. Identifiers are composed with `psycopg.sql`, never formatted as text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.lock_budget import LockBudget, LockMode, run_with_lock_budget
from outbox_migrate.patterns import marker

STATE_SCHEMA = "outbox_migrate"
"""Schema of the tool's own state tables (the runner's ledger lives there too)."""
DDL_LOCK_BUDGET = LockBudget(lock_timeout_ms=2_000, budget_s=30.0)
"""The copy-back's own DDL (its keyset index, the DROP of the source, the progress table's
upgrade): each lock attempt waits at most 2 s — never long in front of a reader — and the
attempts go on for 30 s, a known holder watched, not queued behind."""


@dataclass(frozen=True)
class Relation:
    """A schema-qualified relation name, for SQL composition and for messages."""

    schema: str
    name: str

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)

    def __str__(self) -> str:
        return f"{self.schema}.{self.name}"


def _pg_class(conn: psycopg.Connection[Any], rel: Relation) -> tuple[int, bool] | None:
    """`rel`'s OID and whether it is a partition; None when it does not exist."""
    row = conn.execute(
        "SELECT c.oid::int8, c.relispartition FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
        (rel.schema, rel.name),
    ).fetchone()
    return (int(row[0]), bool(row[1])) if row else None


def exists(conn: psycopg.Connection[Any], rel: Relation) -> bool:
    return _pg_class(conn, rel) is not None


def backlog(
    conn: psycopg.Connection[Any], spec: OutboxSpec, table: str
) -> tuple[int, float | None] | None:
    """`table`'s unpublished rows and the oldest one's age in seconds (None with no row);
    None when the table does not exist. The partial index on unpublished ids makes it cheap."""
    name = sql.Identifier(spec.schema, table)
    found = conn.execute("SELECT to_regclass(%s)", (name.as_string(conn),)).fetchone()
    if not found or found[0] is None:
        return None
    query = sql.SQL("SELECT count(*), extract(epoch FROM now() - min({})) FROM {} WHERE {}")
    row = conn.execute(
        query.format(sql.Identifier(spec.created_column), name, marker.unpublished(spec))
    ).fetchone()
    if row is None:
        return None
    return int(row[0]), float(row[1]) if row[1] is not None else None


def oid_of(conn: psycopg.Connection[Any], rel: Relation) -> int | None:
    found = _pg_class(conn, rel)
    return found[0] if found else None


def is_partition(conn: psycopg.Connection[Any], rel: Relation) -> bool:
    found = _pg_class(conn, rel)
    return found is not None and found[1]


def columns(conn: psycopg.Connection[Any], rel: Relation) -> list[str]:
    """Ordinary (writable) columns in attribute order: no dropped or generated columns."""
    rows = conn.execute(
        "SELECT a.attname FROM pg_attribute a"
        " JOIN pg_class c ON c.oid = a.attrelid"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped"
        " AND a.attgenerated = '' ORDER BY a.attnum",
        (rel.schema, rel.name),
    ).fetchall()
    return [str(r[0]) for r in rows]


def _has_index(conn: psycopg.Connection[Any], rel: Relation, column: str, kind: str) -> bool:
    """A valid, non-partial index of `rel` whose first key is `column`, and `kind` holds."""
    row = conn.execute(
        "SELECT 1 FROM pg_index i"
        " JOIN pg_class ic ON ic.oid = i.indexrelid JOIN pg_am am ON am.oid = ic.relam"
        " JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
        " JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = i.indkey[0]"
        " WHERE n.nspname = %s AND c.relname = %s AND i.indisvalid AND i.indpred IS NULL"
        f" AND a.attname = %s AND {kind}",
        (rel.schema, rel.name, column),
    ).fetchone()
    return row is not None


def has_unique_index_on(conn: psycopg.Connection[Any], rel: Relation, column: str) -> bool:
    """True when a valid unique index covers exactly `column` (ON CONFLICT needs one)."""
    return _has_index(conn, rel, column, "i.indisunique AND i.indnatts = 1")


def has_btree_leading(conn: psycopg.Connection[Any], rel: Relation, column: str) -> bool:
    """True when a valid, non-partial btree index starts with `column` (keyset scans)."""
    return _has_index(conn, rel, column, "am.amname = 'btree'")


def ddl_under_budget(
    conn: psycopg.Connection[Any],
    label: str,
    rel: Relation,
    mode: LockMode,
    body: Callable[[psycopg.Connection[Any]], object],
) -> None:
    """`body` in one transaction that holds `mode` on `rel`, under `DDL_LOCK_BUDGET`."""
    run_with_lock_budget(conn, label, DDL_LOCK_BUDGET, body, relations=((rel.name, mode),),
                         schema=rel.schema)  # fmt: skip


def column_list(names: Sequence[str], alias: str | None = None) -> sql.Composed:
    if alias is None:
        return sql.SQL(", ").join(sql.Identifier(n) for n in names)
    return sql.SQL(", ").join(sql.Identifier(alias, n) for n in names)


def ensure_state_schema(conn: psycopg.Connection[Any]) -> None:
    """CREATE SCHEMA IF NOT EXISTS, tolerating a concurrent creator (the runner)."""
    try:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(STATE_SCHEMA)))
    except psycopg.errors.UniqueViolation:
        # Two sessions ran IF NOT EXISTS at the same moment; the other one created it.
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.rollback()


def fit_identifier(name: str, suffix: str) -> str:
    """`name` + `suffix` cut to PostgreSQL's 63-byte limit, keeping the suffix."""
    limit = 63 - len(suffix.encode())
    return name.encode()[:limit].decode(errors="ignore") + suffix
