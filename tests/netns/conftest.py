"""Fixtures of the multi-host test bed: tools present (a loud failure in CI), one PostgreSQL
listening on every host's root-side address, a fresh outbox database per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import create_partitioned_outbox
from psycopg import sql

from .bed import SUBNET, missing_tools


def _require_the_bed() -> None:
    problems = [f"{tool} not found (Debian: iproute2, nftables)" for tool in missing_tools()]
    if os.geteuid() != 0:
        problems.append("network namespaces need root")
    if not problems:
        return
    reason = "the multi-host test bed cannot run: " + "; ".join(problems) + " (docs/development.md)"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def bed_server() -> Iterator[pgserver.Server]:
    """PostgreSQL (the newest configured version) reachable from the namespaces."""
    _require_the_bed()
    version = max(pgserver.parse_versions(os.environ.get("OUTBOX_MIGRATE_TEST_PG")))
    server = pgserver.start(version)
    try:
        assert server.data_dir is not None and server.bin_dir is not None
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET listen_addresses = '*'")
        hba = server.data_dir / "pg_hba.conf"
        hba.write_text(hba.read_text() + f"host all all {SUBNET}.0.0/16 trust\n")
        pgserver._run_as_server_user(
            [str(server.bin_dir / "pg_ctl"), "-D", str(server.data_dir), "-w", "-m", "fast",
             "-l", str(Path(server.data_dir).parent / "server.log"), "restart"]
        )  # fmt: skip
        yield server
    finally:
        server.stop()


@pytest.fixture
def bed_database(bed_server: pgserver.Server) -> Iterator[str]:
    name = f"bed_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(bed_server.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    with psycopg.connect(bed_server.dsn(name), autocommit=True) as conn:
        create_partitioned_outbox(conn, start=1)
    yield name
    with psycopg.connect(bed_server.dsn(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
