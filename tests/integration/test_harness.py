"""The test harness itself: real servers, a fresh database per test, cloned from a template."""

from __future__ import annotations

import psycopg
from outbox_migrate_harness.testing.server import Server

from outbox_migrate.db import APPLICATION_NAME, connect, server_version


def test_database_is_fresh_and_isolated(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public'"
        ).fetchone()
        assert row == (0,)
        conn.execute("CREATE TABLE outbox (id int8)")
        name = conn.info.dbname
    assert name.startswith("t_")


def test_server_version_matches_parameter(pg_server: Server, dsn: str) -> None:
    with connect(dsn) as conn:
        assert server_version(conn) == pg_server.version


def test_connections_carry_application_name(dsn: str) -> None:
    with connect(dsn) as conn:
        row = conn.execute("SHOW application_name").fetchone()
    assert row == (APPLICATION_NAME,)
