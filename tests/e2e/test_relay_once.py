"""`relay --once` is `relay --until-empty` (maintain spells the same idea `--once`)."""

from __future__ import annotations

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_partitioned_outbox, insert_rows

from tests.support.cli import run_cli


@pytest.mark.newest_pg_only
def test_relay_once_publishes_what_is_there_and_exits_0(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_partitioned_outbox(conn)
        insert_rows(conn, "outbox_new", 3)
    result = run_cli("relay", "--sink", "stdout", "--once", "--no-listen", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) == 3
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_unpublished").fetchone() == (0,)
