"""A tiny stand-in for the application between deploys: what each version does to the outbox.

Used by the catalog/plan tests to simulate a rolling deploy phase by phase (the proof harness
under load lives in outbox_migrate_harness.sim).
"""

from __future__ import annotations

import psycopg
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.patterns.model import Phase, Table

ROWS_PER_PHASE = 7


def act_as(
    conn: psycopg.Connection, phase: Phase, *, old: str = "outbox", new: str = "outbox_new"
) -> None:
    """Do what `phase`'s application version does: insert some rows, publish what it may."""
    if phase.app.renamed:  # the partitioned table goes by the original name
        new = old
    target = old if phase.app.inserts_into is Table.OLD else new
    insert_rows(conn, target, ROWS_PER_PHASE)
    source = phase.app.publishes_from
    if source in (Table.OLD, Table.OLD_THEN_NEW):
        publish_all(conn, old)
    if source in (Table.NEW, Table.OLD_THEN_NEW):
        publish_all(conn, new)


def publish_all(conn: psycopg.Connection, table: str) -> int:
    cur = conn.execute(
        psycopg.sql.SQL("UPDATE {} SET published_at = now() WHERE published_at IS NULL").format(
            psycopg.sql.Identifier(table)
        )
    )
    return cur.rowcount


def count(conn: psycopg.Connection, table: str) -> int:
    row = conn.execute(
        psycopg.sql.SQL("SELECT count(*) FROM {}").format(psycopg.sql.Identifier(table))
    ).fetchone()
    assert row is not None
    return int(row[0])


def violations(conn: psycopg.Connection, conditions: list) -> list[str]:
    found: list[str] = []
    for condition in conditions:
        found.extend(str(r[0]) for r in conn.execute(condition.query).fetchall())
    return found


def exercise(dsn: str, phase: Phase, *, old: str = "outbox", new: str = "outbox_new") -> None:
    """Run `phase`'s application statements (insert one row, publish from where it
    publishes) in a transaction that is rolled back: proves they still work, changes nothing."""
    if phase.app.renamed:  # the partitioned table goes by the original name
        new = old
    target = old if phase.app.inserts_into is Table.OLD else new
    sources = {
        Table.OLD: [old],
        Table.NEW: [new],
        Table.OLD_THEN_NEW: [old, new],
        Table.NONE: [],
    }[phase.app.publishes_from]
    with psycopg.connect(dsn) as conn:
        conn.execute("SET lock_timeout = '5s'")
        insert_rows(conn, target, 1)
        for source in sources:
            conn.execute(
                psycopg.sql.SQL(
                    "UPDATE {t} SET published_at = now() WHERE id IN "
                    "(SELECT id FROM {t} WHERE published_at IS NULL ORDER BY id LIMIT 10 "
                    "FOR UPDATE SKIP LOCKED)"
                ).format(t=psycopg.sql.Identifier(source))
            )
        conn.rollback()
