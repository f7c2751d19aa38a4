"""CDC relay fixtures: a partitioned outbox whose database's replication slots are dropped
after the test (a database with a slot cannot be dropped, and slots are a server-wide,
limited resource)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import create_partitioned_outbox
from psycopg import sql

from outbox_migrate.patterns.kinds import dead_letter_tables
from outbox_migrate.relay import library_logs
from outbox_migrate.relay.cdc.relay import CdcRelay
from outbox_migrate.relay.options import CdcOptions
from outbox_migrate.relay.sinks import SinkFactory
from tests.integration.relay.conftest import PARTITIONED_START, SPEC


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


@pytest.fixture
def other_database(pg_server: pgserver.Server) -> Iterator[str]:
    """A second database on the same server with its own partitioned outbox (slot names
    are server-wide: a relay there must not touch this test's slots)."""
    from tests.fixtures.postgres import TEMPLATE_DB

    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_server.dsn(), autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(TEMPLATE_DB)
            )
        )
    other = pg_server.dsn(name)
    try:
        with psycopg.connect(other, autocommit=True) as conn:
            create_partitioned_outbox(conn, SPEC, start=PARTITIONED_START)
        yield other
    finally:
        drop_slots(other)
        with psycopg.connect(pg_server.dsn(), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)
            ))  # fmt: skip


@pytest.fixture
def cdc_role(dsn: str, cdc_outbox: psycopg.Connection) -> Iterator[str]:
    """A least-privilege CDC relay role: LOGIN REPLICATION, may read and mark the outbox and
    use pre-created dead-letter tables, owns the pre-created publication (it records the
    backlog's completion in its comment), and cannot create a table (no CREATE on the
    schema). Returns its DSN."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    role = f"om_cdc_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    conn = cdc_outbox
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION").format(ident))
    conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    for create in (dead_letter_tables.create_dead_letter, dead_letter_tables.create_attempts):
        suffix = "_attempts" if create is dead_letter_tables.create_attempts else ""
        conn.execute(create(SPEC.schema, "outbox_dead_letter" + suffix))
    conn.execute(
        sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {}")
        .format(ident)
    )  # fmt: skip
    conn.execute(
        "CREATE PUBLICATION outbox_migrate_cdc FOR TABLE outbox_unpublished "
        "WITH (publish = 'insert')"
    )
    # A publication's owner needs CREATE on the database (not on any schema).
    conn.execute(
        sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(conn.info.dbname), ident)
    )
    conn.execute(sql.SQL("ALTER PUBLICATION outbox_migrate_cdc OWNER TO {}").format(ident))
    params = conninfo_to_dict(dsn)
    params["user"] = role
    params.pop("password", None)
    try:
        yield make_conninfo(**params)
    finally:
        drop_slots(dsn)
        conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))


@pytest.fixture
def unrouted() -> Iterator[list[logging.LogRecord]]:
    """pika's logger as a fresh process has it (another test may have routed it already),
    and every record the root logger sees."""
    pika = logging.getLogger("pika")
    saved = (list(pika.handlers), pika.propagate)
    for handler in list(pika.handlers):
        pika.removeHandler(handler)
    pika.propagate = True
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    root, keep = logging.getLogger(), Keep()
    level = root.level
    root.addHandler(keep)
    root.setLevel(logging.DEBUG)
    try:
        yield seen
    finally:
        root.removeHandler(keep)
        root.setLevel(level)
        for handler in list(pika.handlers):
            pika.removeHandler(handler)
        for handler in saved[0]:
            pika.addHandler(handler)
        pika.propagate = saved[1]
        library_logs.route()
