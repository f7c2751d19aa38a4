"""The optional original-name phases under live load: HOPER and HOPIA to the end, then the
rename while the previous version inserts into the former name (now a view) and its relay
marks through it, the next version writing to and publishing from the original name, and the
view's drop once the previous version is gone. Nothing lost, no insert error, invariants hold;
on every configured server (OUTBOX_MIGRATE_TEST_PG=14,18)."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest
from psycopg import sql

from tests.e2e.test_zoo import DEBEZIUM, QUOTED, SPEC_TABLE
from tests.support.zoo import ZooTable, check_delivery, migrate_under_load

TABLES = [
    dataclasses.replace(table, include_optional=True, original_name=True)
    for table in (SPEC_TABLE, QUOTED, DEBEZIUM)
]


@pytest.mark.parametrize("zoo", TABLES, ids=lambda t: t.name)
@pytest.mark.parametrize("pattern", ["hoper", "hopia"])
def test_original_name_under_load(pattern: str, zoo: ZooTable, dsn: str) -> None:
    outcome, _ = migrate_under_load(dsn, zoo, pattern)
    check_delivery(outcome, zoo)
    assert outcome.writer_errors == []
    spec = zoo.spec_settings().spec
    with psycopg.connect(dsn, autocommit=True) as conn:
        kinds = conn.execute(
            "SELECT (SELECT relkind::text FROM pg_class WHERE oid = to_regclass(%s)), "
            "to_regclass(%s), "
            "(SELECT count(*) FROM outbox_migrate.step WHERE step_id LIKE %s AND state = 'done')",
            (
                sql.Identifier(spec.schema, spec.table).as_string(None),
                sql.Identifier(spec.schema, spec.partitioned_table).as_string(None),
                f"{pattern}.%original-name%",
            ),
        ).fetchone()
    assert kinds == ("p", None, 1)


@pytest.mark.parametrize("pattern", ["hoper", "hopia"])
def test_rename_rolled_back_and_applied_again_under_load(pattern: str, dsn: str) -> None:
    """The way back is as quiet as the way forward: the previous version keeps writing and
    publishing while the rename is undone and done again."""
    zoo = dataclasses.replace(TABLES[0], roll_back_rename=True)
    outcome, _ = migrate_under_load(dsn, zoo, pattern)
    check_delivery(outcome, zoo)
    assert outcome.writer_errors == []
    with psycopg.connect(dsn, autocommit=True) as conn:
        states = conn.execute(
            "SELECT state FROM outbox_migrate.step WHERE step_id LIKE %s",
            (f"{pattern}.original-name.%",),
        ).fetchall()
        attempts = conn.execute(
            "SELECT count(*) FROM outbox_migrate.attempt WHERE step_id LIKE %s "
            "AND outcome = 'done'",
            (f"{pattern}.original-name.%",),
        ).fetchone()
    assert states == [("done",)]
    assert attempts == (2,)  # applied, undone, applied again
