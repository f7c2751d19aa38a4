"""The relay's libpq-level pipeline (relay/wire.py) against a real server: results land in
their slots across several Syncs, the first error is raised with psycopg's class once the
pipeline is read, the transaction can be paused for ordinary statements and resumed, and the
prepared statements survive what the worker does to its session."""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg import errors as pg_errors

from outbox_migrate.relay.wire import Wire, direct

SELECT_AFTER = b"SELECT g FROM generate_series(1, %(n)s) g WHERE g > %(after)s ORDER BY g"
INSERT = b"INSERT INTO w(v) VALUES (%(v)s)"


@pytest.fixture
def wire(conn: psycopg.Connection) -> Wire:
    conn.execute("CREATE TABLE w (v int PRIMARY KEY)")
    conn.prepare_threshold = None  # as the relay's worker sessions (worker.py)
    return Wire(conn)


def test_results_of_two_syncs_are_read_in_one_go(wire: Wire, conn: psycopg.Connection) -> None:
    with wire.pipeline():
        wire.send_plain(b"BEGIN")
        wire.send(INSERT, {"v": 1})
        commit = wire.send_plain(b"COMMIT")
        wire.send_sync()  # the COMMIT goes out now; its result is read with the next Sync's
        assert conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.INERROR
        wire.send_plain(b"BEGIN")
        rows = wire.send(SELECT_AFTER, {"n": 5, "after": 2})
        wire.sync()
        assert commit.succeeded
        assert wire.rows(rows) == [(3,), (4,), (5,)]
        wire.send_plain(b"ROLLBACK")
    assert conn.execute("SELECT v FROM w").fetchall() == [(1,)]


def test_the_first_error_is_raised_as_psycopg_would_and_the_rest_is_aborted(
    wire: Wire, conn: psycopg.Connection
) -> None:
    conn.execute("INSERT INTO w VALUES (1)")
    with pytest.raises(pg_errors.UniqueViolation), wire.pipeline():
        wire.send_plain(b"BEGIN")
        wire.send(INSERT, {"v": 2})
        wire.send(INSERT, {"v": 1})  # fails
        later = wire.send(INSERT, {"v": 3})  # aborted by the server
        commit = wire.send_plain(b"COMMIT")
        wire.sync()
    assert not later.succeeded and not commit.succeeded
    # Pipeline mode was left: the caller rolls back with an ordinary statement.
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
    conn.execute("ROLLBACK")
    assert conn.execute("SELECT v FROM w ORDER BY v").fetchall() == [(1,)]


def test_a_tolerated_statement_fails_its_transaction_only(
    wire: Wire, conn: psycopg.Connection
) -> None:
    """The batch's mark (batch.py): its error is left in its slot, not raised; the COMMIT
    after it rolls its transaction back (the server answers ROLLBACK), and the next
    transaction queued behind it — the next claim — runs as if nothing happened."""
    conn.execute("INSERT INTO w VALUES (1)")
    with wire.pipeline():
        wire.send_plain(b"BEGIN")
        wire.send(INSERT, {"v": 2})
        mark = wire.send(INSERT, {"v": 1}, tolerate=True)  # fails
        commit = wire.send_plain(b"COMMIT")
        wire.send_plain(b"BEGIN")
        wire.send(INSERT, {"v": 3})
        rows = wire.send(SELECT_AFTER, {"n": 5, "after": 3})
        wire.send_plain(b"COMMIT")
        wire.sync()
        assert mark.failed and not mark.succeeded
        assert isinstance(mark.error(conn.info.encoding), pg_errors.UniqueViolation)
        assert commit.result is not None and commit.result.command_status == b"ROLLBACK"
        assert wire.rows(rows) == [(4,), (5,)]
    assert conn.execute("SELECT v FROM w ORDER BY v").fetchall() == [(1,), (3,)]


def test_a_tolerated_statement_leaves_with_the_next_sync_not_on_its_own(
    wire: Wire, conn: psycopg.Connection, dsn: str
) -> None:
    """The mark's Sync is queued, not flushed: mark and COMMIT reach the server in one network
    write (one wake-up of its backend per batch). Seen from another session: the tolerated
    statement's advisory lock is not taken until `send_sync` sends it with the COMMIT."""
    held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242"
    with psycopg.connect(dsn, autocommit=True) as other, wire.pipeline():
        wire.send_plain(b"BEGIN")
        wire.send(b"SELECT pg_advisory_lock(%(key)s)", {"key": "4242"}, tolerate=True)
        wire.send_plain(b"COMMIT")
        time.sleep(0.3)  # time enough for a statement that had left to run
        before = other.execute(held).fetchone()
        wire.send_sync()
        deadline = time.monotonic() + 5
        while other.execute(held).fetchone() == (0,) and time.monotonic() < deadline:
            time.sleep(0.01)
        after = other.execute(held).fetchone()
        wire.send(b"SELECT pg_advisory_unlock(%(key)s)", {"key": "4242"})
        wire.sync()
    assert (before, after) == ((0,), (1,))


def test_a_commit_that_succeeded_before_a_failing_claim_is_known(
    wire: Wire, conn: psycopg.Connection
) -> None:
    """The worker's accounting: batch k's COMMIT and batch k+1's claim share a round trip; if
    the claim fails, the COMMIT's own result says whether batch k is in."""
    with pytest.raises(pg_errors.DivisionByZero), wire.pipeline():
        wire.send_plain(b"BEGIN")
        wire.send(INSERT, {"v": 7})
        commit = wire.send_plain(b"COMMIT")
        wire.send_plain(b"BEGIN")
        wire.send(b"SELECT 1 / %(zero)s", {"zero": 0})
        wire.sync()
    assert commit.succeeded
    conn.execute("ROLLBACK")
    assert conn.execute("SELECT v FROM w").fetchall() == [(7,)]


def test_ordinary_statements_run_inside_the_pipelines_transaction(
    wire: Wire, conn: psycopg.Connection
) -> None:
    """The rejection path: `direct` pauses the pipeline, the transaction stays open."""
    with wire.pipeline():
        wire.send_plain(b"BEGIN")
        wire.send(INSERT, {"v": 1})
        direct(conn, wire).execute("INSERT INTO w VALUES (2)")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        wire.send(INSERT, {"v": 3})
        wire.send_plain(b"ROLLBACK")
    assert conn.execute("SELECT count(*) FROM w").fetchone() == (0,)


def test_prepared_statements_survive_a_rollback_through_psycopg(
    wire: Wire, conn: psycopg.Connection
) -> None:
    """With psycopg's automatic preparing off, a ROLLBACK through psycopg does not send
    DEALLOCATE ALL (which took the relay's statements with it when it was on)."""
    for _ in range(6):  # past psycopg's default prepare threshold
        conn.execute("SELECT v FROM w WHERE v = %s", (1,))
    with wire.pipeline():
        rows = wire.send(SELECT_AFTER, {"n": 2, "after": 0})
        wire.sync()
    assert wire.rows(rows) == [(1,), (2,)]
    conn.execute("BEGIN")
    conn.execute("ROLLBACK")
    with wire.pipeline():
        rows = wire.send(SELECT_AFTER, {"n": 2, "after": 1})
    assert wire.rows(rows) == [(2,)]


def test_a_lost_session_raises_on_every_read_instead_of_spinning(
    wire: Wire, conn: psycopg.Connection, dsn: str
) -> None:
    """A session the server ended while a Sync was pending: the first read raises, and so does
    every later one (the read-ahead session's cleanup reads again after the error). Before,
    the second read found no result and a dead connection and looped for ever."""
    import threading

    pid = conn.info.backend_pid
    wire.send_plain(b"BEGIN")
    wire.send(b"SELECT pg_sleep(30)")
    wire.send_sync()
    with psycopg.connect(dsn, autocommit=True) as admin:
        while not admin.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND query LIKE 'SELECT pg_sleep%%'",
            (pid,),
        ).fetchone():
            pass
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    outcomes: list[BaseException | None] = []

    def read_twice() -> None:
        for _ in range(2):
            try:
                wire.sync()
                outcomes.append(None)
            except psycopg.OperationalError as exc:
                outcomes.append(exc)

    reader = threading.Thread(target=read_twice, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "a read on the lost session never returned"
    assert len(outcomes) == 2 and all(isinstance(o, psycopg.OperationalError) for o in outcomes)
    wire.close()  # leaves pipeline mode on the dead session, as the worker's cleanup does


def test_preparing_on_a_lost_session_is_a_lost_connection(
    wire: Wire, conn: psycopg.Connection, dsn: str
) -> None:
    """libpq's own result for a dead session has no SQLSTATE; before, it became psycopg's
    generic DatabaseError, which the worker does not retry, and a relay whose read-ahead
    session was cut while it prepared its statements stopped for good."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
    with pytest.raises(psycopg.OperationalError):
        wire.prepare(b"SELECT 1")
