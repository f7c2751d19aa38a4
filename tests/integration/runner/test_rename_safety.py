"""The rename phases in any order an operator can type, as the roles the docs name: the runner
as the table's (non-superuser) owner, the application as a role with INSERT only.

- `original-name` after a migration run to its end *without* --with-optional: the optional
  steps it passed by (SET NOT NULL, which needs the CHECK `drop-check` removed) stay passed by;
  HOPIA's optional drop of its detached partition runs then, as the rename needs its name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_migrate.config import load_settings
from outbox_migrate.runner import Runner
from outbox_migrate.runner import inspect as read_only
from outbox_migrate.testing.schema import create_flat_outbox, insert_rows
from tests.integration.relay.test_least_privilege import Roles
from tests.support.app import act_as, count, publish_all

FAST = {"gate_window_s": 0.2, "lock_budget_s": 10.0}


def settings(**extra: Any) -> Any:
    return load_settings({**FAST, **extra}, environ={})


@pytest.fixture
def roles(dsn: str) -> Iterator[Roles]:
    made = Roles(dsn)
    try:
        yield made
    finally:
        made.drop()


def unpublished(conn: psycopg.Connection, table: str) -> int:
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NULL").format(sql.Identifier(table))
    ).fetchone()
    assert row is not None
    return int(row[0])


def run_without_optional(owner: psycopg.Connection, app: psycopg.Connection, name: str) -> int:
    """Every required phase, as docs/runner.md and every `Next:` line show it (no
    --with-optional), the application writing and publishing as each version does."""
    dsn = owner.info.dsn
    written = 0
    pattern = Runner(dsn, settings(), name).pattern
    for index, phase in enumerate(pattern.phases[1:], start=1):
        if pattern.phases[index - 1].app.publishes_from.value in ("old", "old-then-new"):
            publish_all(app, "outbox")
        with Runner(dsn, settings(), name) as runner:
            assert runner.run(phase.name).phase == phase.name
        act_as(app, phase)
        written += 7
    assert read_only.status(dsn, settings())["state"] == "completed"
    return written


@pytest.mark.parametrize("name", ["hoper", "hopia"])
def test_original_name_after_a_migration_run_without_optional(
    name: str, dsn: str, roles: Roles
) -> None:
    """Before: "original-name before V4: run --to V4 first" on a completed migration, then
    exit 5 (`set-not-null` needs the CHECK `drop-check` removed)."""
    with (
        psycopg.connect(roles.owner_dsn, autocommit=True) as owner,
        psycopg.connect(roles.app_dsn, autocommit=True) as app,
    ):
        create_flat_outbox(owner)
        owner.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE ON outbox TO {}").format(
                sql.Identifier(roles.app)
            )
        )
        insert_rows(owner, "outbox", 50, published=True)
        written = 50 + run_without_optional(owner, app, name)

        with Runner(roles.owner_dsn, settings(), name, include_optional=True) as runner:
            ran = runner.run("original-name").ran
        assert f"{name}.v4.set-not-null" not in ran
        assert ran[-1] == f"{name}.original-name.take-original-name"
        # The previous version inserts through the view, the next one by the original name.
        insert_rows(app, "outbox_new", 3)
        insert_rows(app, "outbox", 3)
        written += 6
        publish_all(app, "outbox")
        assert read_only.verify(roles.owner_dsn, settings(), include_optional=True) == (
            "original-name"
        )
        with Runner(roles.owner_dsn, settings(), name, include_optional=True) as runner:
            assert runner.run("drop-view").completed
            assert runner.verify() == []
        assert count(owner, "outbox") == written
        assert unpublished(owner, "outbox") == 0
