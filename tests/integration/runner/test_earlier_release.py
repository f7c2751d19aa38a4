"""A migration started with release 0.1 and carried on with this one.

Release 0.2 changed the first V2 step (`create-partitioned-table`: its own identity for serial
ids, CHECK constraints copied). A team half-way through a 0.1 migration that upgraded the tool
was refused ("… was applied with definition … but is now …"), with reset as the only way on.
The 0.1 definition's checksum is now a known former one: the ledger row is adopted; any other
changed definition is still refused.
"""

from __future__ import annotations

import psycopg
import pytest

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import build_pattern
from outbox_migrate.runner import ledger
from outbox_migrate.runner.errors import StepChanged

RELEASE_01 = {
    # Computed by release 0.1's own code (commit 33fbda0) for the spec's table.
    "cop": "4352b50950102ddd",
    "copra": "30b2e6b33bd3f282",
    "hop": "830200cc639134d1",
    "hoper": "5f749ef30a204254",
    "hopia": "805f19bd469a8382",
}
STEP = "{}.v2.create-partitioned-table"


@pytest.mark.parametrize("pattern", sorted(RELEASE_01))
def test_the_01_definition_is_a_known_former_one(pattern: str) -> None:
    (step,) = [
        s for s in build_pattern(pattern, OutboxSpec()).steps() if s.id == STEP.format(pattern)
    ]
    assert step.checksum() != RELEASE_01[pattern]
    assert step.former_checksums == (RELEASE_01[pattern],)


def _ledger_after_01(conn: psycopg.Connection, recorded: str) -> ledger.MigrationRow:
    pattern = build_pattern("hoper", OutboxSpec())
    ledger.ensure_schema(conn)
    migration = ledger.open_migration(conn, pattern, OutboxSpec())
    ledger.sync_steps(conn, migration, pattern)
    conn.execute(
        "UPDATE outbox_migrate.step SET state = 'done', checksum = %s "
        "WHERE migration_id = %s AND step_id = %s",
        (recorded, migration.id, STEP.format("hoper")),
    )
    return migration


def test_a_migration_past_the_01_step_is_adopted(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        migration = _ledger_after_01(conn, RELEASE_01["hoper"])
        pattern = build_pattern("hoper", OutboxSpec())
        ledger.sync_steps(conn, migration, pattern)
        (row,) = [r for r in ledger.steps(conn, migration.id) if r.step_id == STEP.format("hoper")]
        assert row.state == "done"
        assert row.checksum == pattern.steps()[0].checksum()


def test_any_other_changed_definition_is_still_refused(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        migration = _ledger_after_01(conn, "0123456789abcdef")
        with pytest.raises(StepChanged):
            ledger.sync_steps(conn, migration, build_pattern("hoper", OutboxSpec()))
