"""Copy-back's progress table on a real server: reading the state runs no DDL, and an older
table is upgraded once, at the job's start."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import build_after_v4

from outbox_migrate.config import OutboxSpec
from outbox_migrate.jobs.copy_back import CopyBack, CopyBackOptions
from outbox_migrate.jobs.throttle import ThrottlePolicy

OPTIONS = CopyBackOptions(batch_rows=400, throttle=ThrottlePolicy(adaptive=False))
PROGRESS = "outbox_migrate.copy_back_progress"


def _uuid_outbox(conn: psycopg.Connection[Any]) -> OutboxSpec:
    conn.execute(
        "CREATE TABLE outbox_u (id uuid PRIMARY KEY, payload jsonb NOT NULL, "
        "published_at timestamptz);"
        "CREATE TABLE outbox_u_published (LIKE outbox_u);"
        "INSERT INTO outbox_u_published SELECT gen_random_uuid(), jsonb_build_object('n', n), "
        "now() FROM generate_series(1, 1000) n"
    )
    return OutboxSpec(
        table="outbox_u", partitioned_table="outbox_u_new",
        unpublished_partition="outbox_u_unpublished", published_partition="outbox_u_published",
        id_kind="application",
    )  # fmt: skip


@pytest.mark.parametrize("ids", ["uuid", "bigint"])
def test_reading_the_state_waits_for_no_reader_of_the_progress_table(
    conn: psycopg.Connection[Any], dsn: str, ids: str
) -> None:
    """A state read used to run `ALTER TABLE … ADD COLUMN IF NOT EXISTS` on the progress
    table (application ids): ACCESS EXCLUSIVE, queued behind any reader of the table. Here a
    session holds ACCESS SHARE on it (an open transaction that read it) while the job plans,
    verifies and stamps: nothing may wait for a lock."""
    spec = _uuid_outbox(conn) if ids == "uuid" else build_after_v4(conn, old_rows=10,
                                                                   published_rows=1000)  # fmt: skip
    assert CopyBack(conn, spec, OPTIONS, dsn=dsn).run().inserted_rows == 1000
    with psycopg.connect(dsn) as reader:
        reader.execute(f"SELECT count(*) FROM {PROGRESS}").fetchone()  # ACCESS SHARE, held
        conn.execute("SET lock_timeout = '2s'")
        try:
            job = CopyBack(conn, spec, OPTIONS, dsn=dsn)
            plan = job.plan()
            assert (plan.state, plan.remaining_rows) == ("verify", 0)
            assert job.verify().passed
        finally:
            conn.execute("RESET lock_timeout")
        held = conn.execute(
            "SELECT mode FROM pg_locks WHERE relation = %s::regclass AND pid = %s",
            (PROGRESS, reader.info.backend_pid),
        ).fetchall()
        assert held == [("AccessShareLock",)]  # the reader really held it throughout
        reader.rollback()


def test_an_older_progress_table_is_read_as_is_and_upgraded_at_the_start(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    """A progress table from before the text mark: an interrupted integer copy-back's
    `high_water` is read without touching the table, and the next run adds `high_water_id`
    once and resumes right after the mark."""
    spec = build_after_v4(conn, old_rows=10, published_rows=2000)
    stopping = CopyBack(conn, spec, OPTIONS, dsn=dsn)
    stop = threading.Event()
    first = stopping.run(progress=lambda _p: stop.set(), stop=stop)
    assert first.stopped and first.inserted_rows == 400
    conn.execute(f"ALTER TABLE {PROGRESS} DROP COLUMN high_water_id")
    plan = CopyBack(conn, spec, OPTIONS, dsn=dsn).plan()
    assert plan.high_water == first.high_water and plan.remaining_rows == 1600
    columns = "SELECT count(*) FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
    before = conn.execute(columns, (PROGRESS,)).fetchone()
    second = CopyBack(conn, spec, OPTIONS, dsn=dsn).run()
    assert second.resumed_from == first.high_water
    assert (second.inserted_rows, second.present_rows) == (1600, 0)
    assert conn.execute(columns, (PROGRESS,)).fetchone() == (before[0] + 1,)  # type: ignore[index]
    mark = conn.execute(f"SELECT high_water, high_water_id FROM {PROGRESS}").fetchone()
    assert mark == (second.high_water, str(second.high_water))
