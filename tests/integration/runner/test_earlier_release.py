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
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.errors import OutOfOrder, PreconditionFailed, StepChanged
from outbox_migrate.patterns import build_pattern
from outbox_migrate.runner import Runner, ledger

RELEASE_01 = {
    # Computed by release 0.1's own code (commit 33fbda0) for the spec's table.
    "cop": "4352b50950102ddd",
    "copra": "30b2e6b33bd3f282",
    "hop": "830200cc639134d1",
    "hoper": "5f749ef30a204254",
    "hopia": "805f19bd469a8382",
}
STEP = "{}.v2.create-partitioned-table"
BEFORE_PRIVILEGES = {
    # The tables' creating steps before they carried the old table's owner and grants
    # (computed by the previous release's code for the spec's table).
    "cop.v2.create-partitioned-table": "1acad6a76bbbf235",
    "cop.v2.create-unpublished-partition": "ef8e12043182c1ec",
    "cop.v2.create-published-partition": "aa07f7c7f5fc6618",
    "copra.v2.create-partitioned-table": "d081f28d8c6e54bf",
    "copra.v2.create-unpublished-partition": "971b3872a6221e40",
    "hop.v2.create-partitioned-table": "0fde441338a5292f",
    "hop.v2.create-unpublished-partition": "9c9186526ada49fc",
    "hop.v2.create-published-partition": "0b4307940d09419c",
    "hoper.v2.create-partitioned-table": "a7b55c72bea16da2",
    "hoper.v2.create-unpublished-partition": "d7a7e4ce341184a2",
    "hoper.v2.create-published-partition": "f69e8bfe5f97e22b",
    "hopia.v2.create-partitioned-table": "92acf259965ef751",
    "hopia.v2.create-unpublished-partition": "284a806e63c34b71",
    "hopia.v2.create-published-partition": "d40908d07c19a427",
    # HOPIA's copy function before it ran with its installer's rights.
    "hopia.v2.install-copy-trigger": "d27058953fe556e3",
}


@pytest.mark.parametrize("pattern", sorted(RELEASE_01))
def test_the_01_definition_is_a_known_former_one(pattern: str) -> None:
    (step,) = [
        s for s in build_pattern(pattern, OutboxSpec()).steps() if s.id == STEP.format(pattern)
    ]
    assert step.checksum() != RELEASE_01[pattern]
    assert step.former_checksums == (RELEASE_01[pattern], BEFORE_PRIVILEGES[step.id])


@pytest.mark.parametrize("step_id", sorted(BEFORE_PRIVILEGES))
def test_the_definitions_before_privileges_travelled_are_known_former_ones(step_id: str) -> None:
    """A migration past V2's creating steps when the tool was upgraded is adopted (the grants
    of tables created before are the operator's, as they were)."""
    pattern = build_pattern(step_id.split(".", maxsplit=1)[0], OutboxSpec())
    (step,) = [s for s in pattern.steps() if s.id == step_id]
    assert step.checksum() != BEFORE_PRIVILEGES[step_id]
    assert BEFORE_PRIVILEGES[step_id] in step.former_checksums


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
        (step,) = [s for s in pattern.steps() if s.id == STEP.format("hoper")]
        assert row.checksum == step.checksum()


def test_any_other_changed_definition_is_still_refused(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        migration = _ledger_after_01(conn, "0123456789abcdef")
        with pytest.raises(StepChanged):
            ledger.sync_steps(conn, migration, build_pattern("hoper", OutboxSpec()))


def test_a_migration_past_v2_without_the_gate_sequence_gets_it_before_the_gate(
    dsn: str,
) -> None:
    """V2 ran with a release whose database-id gates read the id's sequence (no gate
    sequence): `run --to V3` refuses, naming `run --to V2`, which installs it (V2's
    application is already deployed: the step only adds the trigger); then the gate watches
    it."""
    settings = load_settings({"gate_window_s": 0.1}, environ={})
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5, published=True)
        with Runner(dsn, settings, "hop") as runner:
            runner.run("V2")
        # as the earlier release left it: no gate objects, the step not in the ledger
        conn.execute("DROP TRIGGER outbox_gate_tick ON outbox")
        conn.execute("DROP FUNCTION outbox_gate_tick()")
        conn.execute("DROP SEQUENCE outbox_gate_seq")
        for table in ("owned_object", "attempt"):
            conn.execute(
                f"DELETE FROM outbox_migrate.{table} WHERE step_id = 'hop.v2.install-gate-sequence'"
            )
        conn.execute(
            "DELETE FROM outbox_migrate.step WHERE step_id = 'hop.v2.install-gate-sequence'"
        )
        with Runner(dsn, settings, "hop") as runner, pytest.raises(OutOfOrder, match="--to V2"):
            runner.run("V3")
        with Runner(dsn, settings, "hop") as runner:
            assert runner.run("V2").ran == ["hop.v2.install-gate-sequence"]
        conn.execute("INSERT INTO outbox (payload, published_at) VALUES ('{}', now())")
        with (
            Runner(dsn, settings, "hop") as runner,
            pytest.raises(PreconditionFailed, match=r"open transaction|still receiving"),
            psycopg.connect(dsn) as old_writer,
        ):
            old_writer.execute("INSERT INTO outbox (payload, published_at) VALUES ('{}', now())")
            runner.run("V3")
        with Runner(dsn, settings, "hop") as runner:
            assert runner.run("V3").ran == [
                "hop.v3.gate-old-table-retired",
                "hop.v3.remove-gate-sequence",
            ]
