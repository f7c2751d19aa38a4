"""Alembic revisions of an outbox whose publication marker is a flag (`sent boolean NOT NULL
DEFAULT false`), online and offline.

Online, the runner reads the flag's unpublished value from the column's DEFAULT, so revisions
generated without the values still partition `FOR VALUES IN (false)`. Offline SQL has no
database to ask: unpinned, the unpublished partition's step refuses the flag column (a DO
assertion) before anything of it is created; pinned, the SQL partitions by the flag. Before,
revisions of such a table were built as for a timestamp: `FOR VALUES IN (NULL)`, a partition
no row of the flag table ever enters.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
from alembic import command
from outbox_migrate_harness.testing.server import Server

from outbox_migrate.alembic_ext.generate import generate
from outbox_migrate.config import load_settings
from tests.integration.alembic.conftest import APP_REVISION
from tests.support.alembic_project import config_for, offline_sql, psql

FLAG_DDL = """
    CREATE TABLE outbox_sent (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, payload jsonb NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(), sent boolean NOT NULL DEFAULT false);
    INSERT INTO outbox_sent (payload, sent)
    SELECT jsonb_build_object('n', g), g <= 5 FROM generate_series(1, 8) g
"""
NAMES = {
    "table": "outbox_sent",
    "partitioned_table": "outbox_sent_new",
    "unpublished_partition": "outbox_sent_unpublished",
    "published_partition": "outbox_sent_published",
    "published_column": "sent",
}


def unpublished_bound(conn: psycopg.Connection) -> tuple[str, ...] | None:
    row = conn.execute(
        "SELECT pg_get_expr(relpartbound, oid) FROM pg_class "
        "WHERE relname = 'outbox_sent_unpublished'"
    ).fetchone()
    return None if row is None else tuple(row)


def test_online_revisions_read_the_flag_from_its_default(project: Path, dsn: str) -> None:
    targets = generate("hoper", load_settings(NAMES, environ={}), project.parent,
                       tag="f1").phase_targets  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(FLAG_DDL)
        command.upgrade(config_for(project, dsn), APP_REVISION)
        command.upgrade(config_for(project, dsn), targets["V2"])
        assert unpublished_bound(conn) == ("FOR VALUES IN (false)",)
        conn.execute("INSERT INTO outbox_sent_new (payload) VALUES ('{\"n\": 9}')")
        landed = conn.execute(
            "SELECT tableoid::regclass::text FROM outbox_sent_new WHERE payload->>'n' = '9'"
        ).fetchone()
    assert landed == ("outbox_sent_unpublished",)


def test_offline_sql_refuses_an_unpinned_flag_and_partitions_a_pinned_one(
    project_per_migration: Path, tmp_path: Path, pg_server: Server, dsn: str
) -> None:
    unpinned = generate("hoper", load_settings(NAMES, environ={}),
                        project_per_migration.parent, tag="f2").phase_targets  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(FLAG_DDL)
        text = offline_sql(project_per_migration, dsn, None, unpinned["V2"])
        refused = psql(pg_server, dsn, text)
        assert refused.returncode != 0
        assert "sent is boolean, but these steps were built for a timestamp" in refused.stderr
        assert unpublished_bound(conn) is None
    pinned_project = tmp_path / "pinned"
    pinned_project.mkdir()
    ini = _fresh_project(pinned_project)
    pinned = generate(
        "hoper",
        load_settings(
            {**NAMES, "unpublished_value": "false", "published_value": "true"}, environ={}
        ),
        ini.parent,
        tag="f3",
    ).phase_targets
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS outbox_sent_new, alembic_version CASCADE")
        applied = psql(pg_server, dsn, offline_sql(ini, dsn, None, pinned["V2"]))
        assert applied.returncode == 0, applied.stderr
        assert unpublished_bound(conn) == ("FOR VALUES IN (false)",)


def _fresh_project(root: Path) -> Path:
    from tests.integration.alembic.conftest import _init

    return _init(root, per_migration=True)
