"""Every wait of a relay worker refuses to start with a session in a transaction
(relay/waits.py), on real PostgreSQL: a session "idle in transaction" while its worker sleeps
keeps a migration step from its lock (tests/integration/relay/test_wake_up.py)."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from outbox_migrate.relay import wire
from outbox_migrate.relay.driver import Worker
from outbox_migrate.relay.options import RelayOptions
from outbox_migrate.relay.waits import WaitInTransaction, Waits, check_outside_transaction
from outbox_migrate.relay.worker import Relay

from .conftest import SPEC, Collected


def test_a_wait_with_an_open_transaction_raises_before_waiting(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        waits = Waits(threading.Event(), lambda: [(conn, None)])
        waits.wait(0.0)  # outside a transaction: waits
        conn.execute("BEGIN")
        conn.execute("SELECT 1")
        started = time.monotonic()
        for wait in (lambda: waits.wait(5), lambda: waits.sleep(5), lambda: waits.sleep(0.01)):
            with pytest.raises(WaitInTransaction, match="INTRANS"):
                wait()
        assert time.monotonic() - started < 1  # refused, not waited
        conn.execute("COMMIT")
        assert waits.sleep(0.001) is False


def test_a_pipelined_commit_sent_but_unread_lets_the_wait_start(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    """The worker sends a batch's mark and COMMIT before it lingers and reads their results
    with the next claim: libpq reports the session "active" meanwhile, yet it holds nothing
    once the server ran them. A BEGIN sent without its COMMIT still holds: refused."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.prepare_threshold = None
        pipe = wire.Wire(conn)
        with pipe.pipeline():
            pipe.send_plain(b"BEGIN")
            pipe.send(b"SELECT id FROM outbox_unpublished FOR UPDATE")
            pipe.send_plain(b"COMMIT")
            pipe.send_sync()
            assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.ACTIVE
            check_outside_transaction([(conn, pipe)])
            pipe.sync()
            check_outside_transaction([(conn, pipe)])
            pipe.send_plain(b"BEGIN")
            pipe.send(b"SELECT id FROM outbox_unpublished FOR UPDATE")
            pipe.send_sync()
            with pytest.raises(WaitInTransaction):
                check_outside_transaction([(conn, pipe)])
            pipe.sync()  # results read: libpq knows the block is open
            with pytest.raises(WaitInTransaction, match="INTRANS"):
                check_outside_transaction([(conn, pipe)])
            pipe.send_plain(b"ROLLBACK")
            with pytest.raises(WaitInTransaction):  # queued, not sent
                check_outside_transaction([(conn, pipe)])
            pipe.send_sync()
            check_outside_transaction([(conn, pipe)])


def test_a_worker_refuses_to_sleep_inside_a_transaction(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """The worker's idle sleep (and through it every other wait) raises instead of sleeping
    when its claim session is in a transaction; before the one wait primitive it slept."""
    relay = Relay(dsn, collected.factory(), spec=SPEC, options=RelayOptions(listen=False))
    worker = Worker(relay.shared, 0)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            worker.conn = conn
            worker._sleep(0.01)  # outside a transaction: sleeps
            conn.execute("BEGIN")
            conn.execute("SELECT id FROM outbox_unpublished FOR UPDATE")
            started = time.monotonic()
            with pytest.raises(WaitInTransaction):
                worker._sleep(0.3)
            assert time.monotonic() - started < 0.3
            conn.execute("ROLLBACK")
    finally:
        worker.conn = None
        worker.loop.read_ahead.close()
