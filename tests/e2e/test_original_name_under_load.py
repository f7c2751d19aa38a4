"""The optional original-name phases under live load: HOPER and HOPIA to the end, then the
rename while the previous version inserts into the former name (now a view) and its relay
marks through it, the next version writing to and publishing from the original name, and the
view's drop once the previous version is gone. Nothing lost, no insert error, invariants hold;
on every configured server (OUTBOX_MIGRATE_TEST_PG=14,18)."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest

from tests.e2e.test_zoo import SPEC_TABLE
from tests.support.zoo import check_delivery, migrate_under_load

RENAMED = dataclasses.replace(SPEC_TABLE, include_optional=True, original_name=True)


@pytest.mark.parametrize("pattern", ["hoper", "hopia"])
def test_original_name_under_load(pattern: str, dsn: str) -> None:
    outcome, _ = migrate_under_load(dsn, RENAMED, pattern)
    check_delivery(outcome, RENAMED)
    assert outcome.writer_errors == []
    with psycopg.connect(dsn, autocommit=True) as conn:
        kinds = conn.execute(
            "SELECT (SELECT relkind::text FROM pg_class WHERE oid = to_regclass('outbox')), "
            "to_regclass('outbox_new'), "
            "(SELECT count(*) FROM outbox_migrate.step WHERE step_id LIKE %s AND state = 'done')",
            (f"{pattern}.%original-name%",),
        ).fetchone()
    assert kinds == ("p", None, 1)
