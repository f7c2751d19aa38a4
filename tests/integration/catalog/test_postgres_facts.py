"""The PostgreSQL facts the catalog relies on, checked on every supported server version.

If a future release changes one of these, the catalog's lock and scan claims are wrong; these
tests say which.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import (
    create_flat_outbox,
    create_partitioned_outbox,
    insert_rows,
)
from psycopg import errors


def test_detach_concurrently_refused_when_default_partition_exists(
    conn: psycopg.Connection,
) -> None:
    create_partitioned_outbox(conn)
    with pytest.raises(errors.ObjectNotInPrerequisiteState, match="default partition"):
        conn.execute("ALTER TABLE outbox_new DETACH PARTITION outbox_published CONCURRENTLY")
    # …and the same for detaching the NULL partition while the DEFAULT one exists.
    with pytest.raises(errors.ObjectNotInPrerequisiteState, match="default partition"):
        conn.execute("ALTER TABLE outbox_new DETACH PARTITION outbox_unpublished CONCURRENTLY")


def test_attach_skips_scan_only_with_validated_check(conn: psycopg.Connection) -> None:
    create_flat_outbox(conn)
    insert_rows(conn, "outbox", 50_000, published=True)
    conn.execute(
        "CREATE TABLE outbox_new (LIKE outbox INCLUDING DEFAULTS INCLUDING IDENTITY) "
        "PARTITION BY LIST (published_at)"
    )
    conn.execute("CREATE TABLE outbox_unpublished PARTITION OF outbox_new FOR VALUES IN (NULL)")
    conn.execute("ALTER TABLE outbox ALTER COLUMN id DROP IDENTITY")
    conn.execute(
        "ALTER TABLE outbox ADD CONSTRAINT outbox_published_check "
        "CHECK (published_at IS NOT NULL) NOT VALID"
    )
    # NOT VALID is not enough: ATTACH still scans, which a 1 ms statement_timeout turns into
    # an error (50 000 rows cannot be read in 1 ms).
    with conn.transaction():
        conn.execute("SET LOCAL statement_timeout = '1ms'")
        with pytest.raises(errors.QueryCanceled):
            conn.execute("ALTER TABLE outbox_new ATTACH PARTITION outbox DEFAULT")
    conn.execute("ALTER TABLE outbox VALIDATE CONSTRAINT outbox_published_check")
    # Validated: the attach is catalog-only and fits comfortably in 1 s on any machine; the
    # scan-free path is also what the lock-hold benchmark measures at 100 k-10 M rows.
    with conn.transaction():
        conn.execute("SET LOCAL statement_timeout = '1000ms'")
        conn.execute("ALTER TABLE outbox_new ATTACH PARTITION outbox DEFAULT")
    row = conn.execute(
        "SELECT pg_get_expr(relpartbound, oid) FROM pg_class WHERE oid = 'outbox'::regclass"
    ).fetchone()
    assert row == ("DEFAULT",)


def test_partition_may_not_have_identity(conn: psycopg.Connection, pg_server) -> None:
    """PostgreSQL 17+ refuses to attach a table that has its own identity column. Up to 16 the
    attach succeeds, and the partition keeps a second, independent sequence: a direct insert
    into it re-issues ids the parent already handed out. Either way the catalog drops the old
    table's identity before attaching it."""
    create_flat_outbox(conn)
    conn.execute(
        "CREATE TABLE outbox_new (LIKE outbox INCLUDING DEFAULTS INCLUDING IDENTITY) "
        "PARTITION BY LIST (published_at)"
    )
    conn.execute("CREATE TABLE outbox_unpublished PARTITION OF outbox_new FOR VALUES IN (NULL)")
    if pg_server.version >= 17:
        with pytest.raises(errors.ObjectNotInPrerequisiteState, match="identity column"):
            conn.execute("ALTER TABLE outbox_new ATTACH PARTITION outbox DEFAULT")
        return
    conn.execute("ALTER TABLE outbox_new ATTACH PARTITION outbox DEFAULT")
    insert_rows(conn, "outbox_new", 1)
    conn.execute("UPDATE outbox_new SET published_at = now()")
    with pytest.raises(errors.UniqueViolation):
        conn.execute("INSERT INTO outbox (payload, published_at) VALUES ('{}', now())")


def test_id_uniqueness_is_not_enforced_across_partitions(conn: psycopg.Connection) -> None:
    create_partitioned_outbox(conn)
    conn.execute(
        "INSERT INTO outbox_new (id, payload, published_at) OVERRIDING SYSTEM VALUE "
        "VALUES (7, '{}', NULL), (7, '{}', now())"
    )
    row = conn.execute("SELECT count(*) FROM outbox_new WHERE id = 7").fetchone()
    assert row == (2,)
    # And a unique index on the parent must include the partition key, so it cannot help.
    with pytest.raises(errors.FeatureNotSupported):
        conn.execute("CREATE UNIQUE INDEX ON outbox_new (id)")


def test_moving_a_row_locked_elsewhere_raises_serialization_failure(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as setup:
        create_partitioned_outbox(setup)
        insert_rows(setup, "outbox_new", 1)
    mover = psycopg.connect(dsn)
    locker = psycopg.connect(dsn)
    try:
        # The first publisher moves the row (UPDATE of the partition key) but has not committed.
        mover.execute("UPDATE outbox_new SET published_at = now() WHERE published_at IS NULL")
        outcome: list[BaseException | str] = []

        def second_publisher() -> None:
            try:
                locker.execute(
                    "SELECT id FROM outbox_new WHERE published_at IS NULL FOR UPDATE"
                ).fetchall()
                outcome.append("no error")
            except psycopg.Error as exc:
                outcome.append(exc)

        thread = threading.Thread(target=second_publisher)
        thread.start()
        time.sleep(0.3)  # let it queue behind the mover's row lock
        mover.commit()
        thread.join(10)
        assert len(outcome) == 1
        assert isinstance(outcome[0], errors.SerializationFailure), outcome
        assert "moved to another partition" in str(outcome[0])
    finally:
        mover.close()
        locker.close()


def test_moving_a_row_fires_after_insert_trigger_on_destination(
    conn: psycopg.Connection,
) -> None:
    """HOPIA relies on this: the relay's cross-partition UPDATE is DELETE + INSERT, and the
    INSERT fires row triggers on the published partition."""
    create_flat_outbox(conn)
    create_partitioned_outbox(conn, start=1000)
    conn.execute(
        "CREATE FUNCTION copy_row() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "INSERT INTO outbox OVERRIDING SYSTEM VALUE VALUES (NEW.*) ON CONFLICT DO NOTHING; "
        "RETURN NULL; END $$"
    )
    conn.execute(
        "CREATE TRIGGER copy AFTER INSERT ON outbox_published "
        "FOR EACH ROW EXECUTE FUNCTION copy_row()"
    )
    insert_rows(conn, "outbox_new", 25)
    conn.execute("UPDATE outbox_new SET published_at = now() WHERE published_at IS NULL")
    copied = conn.execute("SELECT count(*), min(id) FROM outbox").fetchone()
    assert copied == (25, 1000)
