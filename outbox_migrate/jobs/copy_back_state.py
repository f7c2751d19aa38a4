"""Copy-back's progress table: one row per (source, target) with the high-water mark and the
copied / verified / dropped stamps. Reading the state never runs DDL.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.jobs import common
from outbox_migrate.jobs.common import Relation
from outbox_migrate.lock_budget import LockMode

PROGRESS_TABLE = "copy_back_progress"
TEXT_MARK = "high_water_id"
_PAIR = (
    " WHERE source_schema = %s AND source_table = %s AND target_schema = %s AND target_table = %s"
)
"""The condition that picks one (source, target) pair's row, given `ProgressTable.key`."""


class ProgressTable:
    """The progress row of one (source, target) pair."""

    def __init__(self, conn: psycopg.Connection[Any], source: Relation, target: Relation) -> None:
        self.conn = conn
        self.rel = Relation(common.STATE_SCHEMA, PROGRESS_TABLE)
        self.key = (source.schema, source.name, target.schema, target.name)

    def ensure(self) -> None:
        """Create the table, or give an older one the text mark column (the job's start only)."""
        common.ensure_state_schema(self.conn)
        self.conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {t} ("
                " source_schema text NOT NULL, source_table text NOT NULL,"
                " target_schema text NOT NULL, target_table text NOT NULL,"
                " high_water bigint, high_water_id text,"
                " rows_inserted bigint NOT NULL DEFAULT 0,"
                " rows_present bigint NOT NULL DEFAULT 0,"
                " batches bigint NOT NULL DEFAULT 0,"
                " total_rows bigint,"
                " started_at timestamptz NOT NULL DEFAULT now(),"
                " updated_at timestamptz NOT NULL DEFAULT now(),"
                " copied_at timestamptz, verified_at timestamptz, dropped_at timestamptz,"
                " PRIMARY KEY (source_schema, source_table, target_schema, target_table))"
            ).format(t=self.rel.ident)
        )
        # Only when the catalog says it is missing: ADD COLUMN IF NOT EXISTS would queue an
        # ACCESS EXCLUSIVE lock behind any reader and block every later one.
        if self._has_text_mark():
            return
        statement = sql.SQL("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS {c} text").format(
            t=self.rel.ident, c=sql.Identifier(TEXT_MARK)
        )
        common.ddl_under_budget(
            self.conn, "copy-back.progress-table", self.rel, LockMode.ACCESS_EXCLUSIVE,
            lambda conn: conn.execute(statement),
        )  # fmt: skip

    def _has_text_mark(self) -> bool:
        return TEXT_MARK in common.columns(self.conn, self.rel)

    def read(self) -> dict[str, Any] | None:
        """The pair's row (the mark as text in `high_water`), or None; no lock beyond a read."""
        if not common.exists(self.conn, self.rel):
            return None
        mark = (
            sql.SQL("coalesce({c}, high_water::text)").format(c=sql.Identifier(TEXT_MARK))
            if self._has_text_mark()
            else sql.SQL("high_water::text")
        )
        cur = self.conn.execute(
            sql.SQL(
                "SELECT {mark} AS high_water, rows_inserted, rows_present, batches, total_rows,"
                " copied_at, verified_at, dropped_at FROM {t}" + _PAIR
            ).format(t=self.rel.ident, mark=mark),
            self.key,
        )
        row = cur.fetchone()
        if row is None:
            return None
        names = [d.name for d in cur.description or []]
        return dict(zip(names, row, strict=True))

    def start(self, total_rows: int) -> dict[str, Any]:
        """The row a run continues from: a new one when none exists or the last ended in a
        drop (a source with these names was copied and dropped before; this one is new)."""
        state = self.read()
        if state is not None and state["dropped_at"] is not None:
            self.conn.execute(sql.SQL("DELETE FROM {t}" + _PAIR).format(t=self.rel.ident), self.key)
            state = None
        if state is None:
            self.conn.execute(
                sql.SQL(
                    "INSERT INTO {t} (source_schema, source_table, target_schema, target_table,"
                    " total_rows) VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"
                ).format(t=self.rel.ident),
                (*self.key, total_rows),
            )
            state = self.read()
        assert state is not None
        return state

    def stamp(self, column: str) -> None:
        """Stamp `copied_at`, `verified_at` or `dropped_at`."""
        if not common.exists(self.conn, self.rel):
            return
        self.conn.execute(
            sql.SQL("UPDATE {t} SET {c} = now(), updated_at = now()" + _PAIR).format(
                t=self.rel.ident, c=sql.Identifier(column)
            ),
            self.key,
        )


def finished_and_dropped(conn: psycopg.Connection[Any], spec: OutboxSpec) -> bool:
    """True when a copy-back of `spec`'s published partition ran to its end — copied,
    verified, source dropped, as its progress table records — and the source is gone.

    The runner's copy-back step counts this as proven, whoever ran the job (`outbox-migrate
    copy-back` or `run --to copy-back`)."""
    source = Relation(spec.schema, spec.published_partition)
    if common.exists(conn, source):
        return False
    state = ProgressTable(conn, source, Relation(spec.schema, spec.table)).read()
    return state is not None and None not in (state["dropped_at"], state["verified_at"])
