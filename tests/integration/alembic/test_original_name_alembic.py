"""The original-name phases as generated Alembic revisions (`--with-optional`), online: HOPER
upgraded to its end, then the rename, a downgrade that undoes it, the rename again and the
view's drop; the runner's verify holds on the renamed end state."""

from __future__ import annotations

from pathlib import Path

import psycopg
from alembic import command

from outbox_migrate.alembic_ext.generate import generate
from outbox_migrate.config import load_settings
from outbox_migrate.runner import Runner
from tests.integration.alembic.conftest import APP_REVISION
from tests.integration.alembic.test_fresh_project import before_phase, seed
from tests.support.alembic_project import config_for, version_of
from tests.support.app import act_as

SETTINGS = load_settings({}, environ={})


def kind_of(conn: psycopg.Connection, name: str) -> str | None:
    row = conn.execute(
        "SELECT relkind::text FROM pg_class WHERE oid = to_regclass(%s)", (name,)
    ).fetchone()
    return row[0] if row else None


def test_original_name_through_alembic(project_per_migration: Path, dsn: str) -> None:
    result = generate(
        "hoper", SETTINGS, project_per_migration.parent, tag="t1", include_optional=True
    )
    targets = result.phase_targets
    assert targets["original-name"] == "t1_hoper_original_name_01"
    assert targets["drop-view"] == "t1_hoper_drop_view_02"  # count-view-writes, then the drop
    config = config_for(project_per_migration, dsn)
    with Runner(dsn, SETTINGS, "hoper", include_optional=True) as probe:
        pattern = probe.pattern
    with psycopg.connect(dsn, autocommit=True) as conn:
        seed(conn)
        command.upgrade(config, APP_REVISION)
        for index, phase in enumerate(pattern.phases[1:], start=1):
            if phase.name in ("original-name", "drop-view"):
                break
            before_phase(conn, pattern, index)
            command.upgrade(config, targets[phase.name])
            act_as(conn, phase)
        command.upgrade(config, targets["original-name"])
        assert (kind_of(conn, "outbox"), kind_of(conn, "outbox_new")) == ("p", "v")
        command.downgrade(config, targets["copy-back"])
        assert version_of(conn) == targets["copy-back"]
        assert (kind_of(conn, "outbox"), kind_of(conn, "outbox_new")) == ("r", "p")
        command.upgrade(config, targets["drop-view"])
        assert (kind_of(conn, "outbox"), kind_of(conn, "outbox_new")) == ("p", None)
        with Runner(dsn, SETTINGS, "hoper") as runner:
            assert runner.verify() == []
            assert runner.status()["state"] == "completed"
