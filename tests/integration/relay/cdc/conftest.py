"""CDC relay fixtures: a partitioned outbox whose database's replication slots are dropped
after the test (a database with a slot cannot be dropped, and slots are a server-wide,
limited resource)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import psycopg
import pytest

from outbox_migrate.relay.cdc.options import CdcOptions
from outbox_migrate.relay.cdc.relay import CdcRelay
from outbox_migrate.relay.sinks import SinkFactory
from tests.integration.relay.conftest import SPEC


def drop_slots(dsn: str) -> None:
    """Stop any walsender of this database and drop its slots."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(50):
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                "WHERE database = current_database() AND active_pid IS NOT NULL"
            )
            rows = conn.execute(
                "SELECT slot_name, active FROM pg_replication_slots "
                "WHERE database = current_database()"
            ).fetchall()
            if not rows:
                return
            for name, active in rows:
                if not active:
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
            time.sleep(0.1)


@pytest.fixture
def cdc_outbox(dsn: str, partitioned: psycopg.Connection) -> Iterator[psycopg.Connection]:
    """The partitioned outbox (ids from 1,000,001); slots dropped at teardown."""
    try:
        yield partitioned
    finally:
        drop_slots(dsn)


def slot_row(conn: psycopg.Connection, slot: str = "outbox_migrate_cdc") -> tuple | None:
    """(confirmed_flush_lsn, active, lag bytes behind the server's current position)."""
    return conn.execute(
        "SELECT confirmed_flush_lsn, active, "
        "pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8 "
        "FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    ).fetchone()


def wait_for(check: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.05)


def cdc_relay(dsn: str, sink: SinkFactory, **options: object) -> CdcRelay:
    defaults: dict[str, object] = {"backoff_cap_s": 0.5}
    return CdcRelay(dsn, sink, spec=SPEC, options=CdcOptions(**{**defaults, **options}))  # type: ignore[arg-type]
