"""Alembic revisions carry the old table's grants to the tables they create, online and with
`--sql` applied by psql: the same step SQL reads the ACL when it runs."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
import pytest
from alembic import command
from alembic.util import CommandError
from outbox_migrate_harness.testing.schema import create_flat_outbox
from outbox_migrate_harness.testing.server import Server
from psycopg import sql

from outbox_migrate.alembic_ext.generate import generate
from outbox_migrate.config import load_settings
from tests.integration.alembic.conftest import APP_REVISION
from tests.integration.catalog.test_privileges_travel import acl
from tests.support.alembic_project import config_for, offline_sql, psql, version_of
from tests.support.roles import DocumentedRoles


def test_revisions_carry_the_grants_online_and_offline(
    project: Path, pg_server: Server, dsn: str, other_dsn: str
) -> None:
    app = f"om_app_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(app)
    targets = generate("hop", load_settings({}, environ={}), project.parent, tag="p1")
    v2 = targets.phase_targets["V2"]
    with (
        psycopg.connect(dsn, autocommit=True) as online,
        psycopg.connect(other_dsn, autocommit=True) as offline,
    ):
        online.execute(sql.SQL("CREATE ROLE {}").format(ident))
        try:
            for conn in (online, offline):
                create_flat_outbox(conn)
                conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE ON outbox TO {}").format(ident))
            config = config_for(project, dsn)
            command.upgrade(config, APP_REVISION)
            command.upgrade(config, v2)
            applied = psql(pg_server, other_dsn, offline_sql(project, other_dsn, None, v2))
            assert applied.returncode == 0, applied.stderr
            for conn in (online, offline):
                assert acl(conn, "outbox_new") == {
                    (app, "SELECT", None), (app, "INSERT", None), (app, "UPDATE", None)
                }  # fmt: skip
                # DELETE: a dead-lettered row leaves the outbox that way (grant-dead-letters)
                assert acl(conn, "outbox_unpublished") == {
                    (app, "SELECT", None), (app, "UPDATE", None), (app, "DELETE", None)
                }  # fmt: skip
        finally:
            for conn in (online, offline):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
            online.execute(sql.SQL("DROP ROLE {}").format(ident))


def test_a_missing_privilege_is_one_failed_line(
    project: Path, dsn: str, roles: DocumentedRoles
) -> None:
    # A role without CREATE on the database (the ledger's schema), then without any grant on
    # the outbox (the marker's samples): each used to end `alembic upgrade` with a psycopg
    # traceback where `outbox-migrate run` says one line.
    targets = generate("hoper", load_settings({}, environ={}), project.parent, tag="r1")
    app = sql.Identifier(roles.app)
    with psycopg.connect(dsn, autocommit=True) as admin:
        create_flat_outbox(admin)
        admin.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(app))  # its version
        config = config_for(project, roles.app_dsn)
        command.upgrade(config, APP_REVISION)
        with pytest.raises(CommandError) as database:
            command.upgrade(config, targets.revisions[0]["revision"])
        name = admin.info.dbname
        admin.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(name), app)
        )
        with pytest.raises(CommandError) as table:
            command.upgrade(config, targets.revisions[0]["revision"])
        assert version_of(admin) == APP_REVISION
    for refused, what in ((database, f"database {name}"), (table, "table outbox")):
        assert str(refused.value) == (
            f"permission denied for {what}: the role {roles.app} lacks a privilege the "
            "migration needs (`outbox-migrate roles` checks them, docs/roles.md lists them)"
        )
