"""Every step's declared locks and scans are what PostgreSQL really does, on every version.

Each pattern is walked phase by phase on a real database (the application simulated between
deploys as in the psql end-to-end test). Each step runs inside one transaction; before COMMIT
the test reads `pg_locks` for its own backend and the rows its statements read
(`pg_stat_xact_user_tables`). For each declared relation the strongest lock held must be
exactly the declared mode, and no other outbox relation may be held stronger than ROW
EXCLUSIVE. A step that says it reads a whole table must read every row of it; a catalog-only
step must read none; any other step at most an index probe. A wrong declaration here means
`plan` tells the operator a wrong story about who is blocked and for how long.
"""

from __future__ import annotations

import re

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import PATTERN_NAMES, BuildOptions, build_pattern
from outbox_migrate.patterns.kinds.dead_letter_tables import (
    ATTEMPTS_TABLE_SUFFIX,
    DEAD_LETTER_TABLE,
)
from outbox_migrate.patterns.model import Step, TxMode
from tests.support.app import act_as, count, publish_all, violations

SPEC = OutboxSpec()
OURS = (
    SPEC.table,
    SPEC.partitioned_table,
    SPEC.unpublished_partition,
    SPEC.published_partition,
    DEAD_LETTER_TABLE,
    DEAD_LETTER_TABLE + ATTEMPTS_TABLE_SUFFIX,
)
ORDER = list(LockMode)
ROW_EXCLUSIVE = ORDER.index(LockMode.ROW_EXCLUSIVE)
SCANNED = re.compile(r"reads all of (\S+)")
OUR_RELATIONS = """
SELECT oid, relname FROM pg_class
WHERE relnamespace = 'public'::regnamespace AND relname = ANY (%s)
"""
HELD_LOCKS = """
SELECT relation, mode FROM pg_locks
WHERE pid = pg_backend_pid() AND locktype = 'relation' AND granted
"""


def our_relations(conn: psycopg.Connection) -> dict[int, str]:
    return dict(conn.execute(OUR_RELATIONS, (list(OURS),)).fetchall())


def strongest_locks(conn: psycopg.Connection, names: dict[int, str]) -> dict[str, LockMode]:
    """Strongest lock this backend holds on each of our relations (by oid, so a relation the
    step dropped still counts)."""
    held: dict[str, LockMode] = {}
    for oid, mode in conn.execute(HELD_LOCKS).fetchall():
        relname = names.get(oid)
        if relname is None:
            continue
        lock = LockMode(mode)
        if relname not in held or ORDER.index(lock) > ORDER.index(held[relname]):
            held[relname] = lock
    return held


BATCH_COMMIT = "        COMMIT;\n"


def in_one_transaction(step: Step) -> list[str]:
    """The step's SQL as it can run inside one transaction. copy-back's plain-SQL loop
    commits after every batch; without those COMMITs it takes the same locks, all at once."""
    if step.tx is TxMode.TRANSACTION:
        return step.sql_texts()
    texts = [text.replace(BATCH_COMMIT, "") for text in step.sql_texts()]
    assert texts != step.sql_texts(), f"{step.id}: no per-batch COMMIT to take out"
    return texts


ROWS_READ = """
SELECT relid::int8, coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)
FROM pg_stat_xact_user_tables
WHERE schemaname = 'public' AND relname = ANY (%s)
"""


def rows_read(conn: psycopg.Connection) -> dict[int, int]:
    """Table rows this transaction has read so far, per relation oid (0s left out). By oid:
    the original-name step renames relations, and a name would then count another table."""
    found = conn.execute(ROWS_READ, (list(OURS),)).fetchall()
    return {int(relid): int(read) for relid, read in found if read}


def run_step(conn: psycopg.Connection, step: Step) -> tuple[dict[str, LockMode], dict[str, int]]:
    """Run the step's statements in one transaction; the locks held just before COMMIT and
    the table rows the statements read."""
    names = our_relations(conn)
    with conn.transaction():
        # Pending statistics are flushed only between transactions, so the difference of two
        # readings inside this one is exactly what the step's statements read.
        before = rows_read(conn)
        for text in in_one_transaction(step):
            conn.execute(text)  # type: ignore[call-overload]
        after = rows_read(conn)
        # Relations the step created; a relation it renamed keeps the name it had before,
        # the name the step declares its lock by.
        names.update({o: n for o, n in our_relations(conn).items() if o not in names})
        read = {
            names[rel]: n - before.get(rel, 0)
            for rel, n in after.items()
            if n > before.get(rel, 0) and rel in names
        }
        return strongest_locks(conn, names), read


@pytest.mark.parametrize("pattern", PATTERN_NAMES)
def test_declared_locks_are_the_locks_taken(pattern: str, dsn: str) -> None:
    built = build_pattern(pattern, SPEC, BuildOptions(sample_window_s=0.05, include_optional=True))
    checked: list[str] = []
    wrong: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, SPEC.table, 200, published=True)
        insert_rows(conn, SPEC.table, 10)
        for index, phase in enumerate(built.phases):
            if index:
                previous = built.phases[index - 1]
                if previous.app.publishes_from.value in ("old", "old-then-new"):
                    publish_all(conn, SPEC.table)
            for step in phase.steps:
                # The walk is only meaningful if each step runs in the state it was built for.
                assert violations(conn, list(step.preconditions)) == [], step.id
                if step.tx is TxMode.NONE or not step.statements:
                    continue  # deploy gates: no SQL, no locks
                scanned = SCANNED.match(step.scan)
                rows_before = count(conn, scanned[1]) if scanned else 0
                held, read = run_step(conn, step)
                if scanned:
                    # A step that says it reads a whole table does (and the plan warns of it).
                    if read.get(scanned[1], 0) < rows_before:
                        wrong.append(f"{step.id}: says it reads all {rows_before} rows of "
                                     f"{scanned[1]}, read {read.get(scanned[1], 0)}")  # fmt: skip
                elif step.catalog_only and read:
                    wrong.append(f"{step.id}: catalog-only, but read table rows {read}")
                elif any(n > 1 for n in read.values()):
                    # No scan claimed: at most an index probe such as max(id).
                    wrong.append(f"{step.id}: claims no scan, but read table rows {read}")
                declared = {lock.relation: lock.mode for lock in step.locks}
                for relation, mode in declared.items():
                    if held.get(relation) is not mode:
                        found = held[relation].sql_name if relation in held else "no lock"
                        wrong.append(f"{step.id}: declares {mode.sql_name} on {relation}, "
                                     f"PostgreSQL held {found}")  # fmt: skip
                for relation, mode in held.items():
                    if relation not in declared and ORDER.index(mode) > ROW_EXCLUSIVE:
                        wrong.append(f"{step.id}: undeclared {mode.sql_name} on {relation}")
                assert violations(conn, list(step.postcondition)) == [], step.id
                checked.append(step.id)
            act_as(conn, phase)
    assert not wrong, "\n".join(wrong)
    expected = [s.id for s in built.steps() if s.statements]
    assert checked == expected


def test_held_locks_reader_sees_an_explicit_lock(conn: psycopg.Connection) -> None:
    """The probe itself: a LOCK TABLE inside the transaction shows up with its mode."""
    create_flat_outbox(conn)
    with conn.transaction():
        conn.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(sql.Identifier(SPEC.table)))
        assert strongest_locks(conn, our_relations(conn)) == {SPEC.table: LockMode.SHARE}
