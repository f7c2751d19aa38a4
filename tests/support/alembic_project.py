"""Helpers for the Alembic tests: a project's Config for a test database, offline SQL,
psql, and a catalog dump to compare two databases' schemas."""

from __future__ import annotations

import io
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from outbox_migrate_harness.testing.server import Server
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import URL

from tests.fixtures.postgres import TEMPLATE_DB

GATE_ENV = {"OUTBOX_MIGRATE_GATE_WINDOW_S": "0.1", "OUTBOX_MIGRATE_LOCK_BUDGET_S": "10"}


def sqlalchemy_url(dsn: str) -> str:
    """A libpq key=value DSN as a `postgresql+psycopg://` URL (password included)."""
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    host = params.get("host")
    query = {}
    if host and host.startswith("/"):
        query["host"] = host
        host = None
    url = URL.create(
        "postgresql+psycopg",
        username=params.get("user"),
        password=params.get("password"),
        host=host,
        port=int(params["port"]) if params.get("port") else None,
        database=params.get("dbname"),
        query=query,
    )
    return url.render_as_string(hide_password=False)


def config_for(ini: Path, dsn: str, buffer: io.StringIO | None = None) -> Config:
    config = Config(str(ini), output_buffer=buffer, stdout=io.StringIO())
    config.set_main_option("sqlalchemy.url", sqlalchemy_url(dsn).replace("%", "%%"))
    return config


def offline_sql(ini: Path, dsn: str, start: str | None, end: str) -> str:
    """`alembic upgrade start:end --sql` (from base when start is None)."""
    buffer = io.StringIO()
    command.upgrade(config_for(ini, dsn, buffer), f"{start}:{end}" if start else end, sql=True)
    return buffer.getvalue()


def chain(ini: Path) -> list[str]:
    """Revision ids from base to head."""
    script = ScriptDirectory.from_config(Config(str(ini)))
    return [rev.revision for rev in reversed(list(script.walk_revisions("base", "heads")))]


def psql(server: Server, dsn: str, sql_text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [server.tool("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", "-"],
        input=sql_text,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def schema_dump(server: Server, dsn: str) -> str:
    """`pg_dump --schema-only` without the ledger schema, comments or session noise."""
    result = subprocess.run(
        [server.tool("pg_dump"), "--schema-only", "--no-owner", "--no-privileges",
         "--exclude-schema=outbox_migrate", "-d", dsn],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    keep = [
        line
        for line in result.stdout.splitlines()
        if line.strip() and not line.startswith("--") and not re.match(r"\\(un)?restrict", line)
    ]
    return "\n".join(keep)


def version_of(conn: object) -> str | None:
    row = conn.execute("SELECT version_num FROM alembic_version").fetchone()  # type: ignore[attr-defined]
    return row[0] if row else None


@pytest.fixture
def other_dsn(pg_server: Server) -> Iterator[str]:
    """A second fresh database on the same server (offline SQL is applied there)."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(TEMPLATE_DB)
            )
        )
    try:
        yield pg_server.dsn(name)
    finally:
        with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
