"""HOPER's copy-back on a real server: resume after SIGKILL, verification, refused drop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import build_after_v4
from psycopg import sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import RunnerBusy, SchemaError
from outbox_migrate.jobs.copy_back import (
    CopyBack,
    CopyBackError,
    CopyBackOptions,
    VerificationFailed,
    copy_back,
)
from outbox_migrate.jobs.throttle import ThrottlePolicy

UNTHROTTLED = CopyBackOptions(throttle=ThrottlePolicy(adaptive=False))


def _count(conn: psycopg.Connection[Any], table: str) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table)))
    return int(row.fetchone()[0])  # type: ignore[index]


def _exists(conn: psycopg.Connection[Any], table: str) -> bool:
    return conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is not None  # type: ignore[index]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox_migrate", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_copies_verifies_and_drops_with_late_rows_interleaved(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    spec = build_after_v4(conn, old_rows=500, published_rows=20_000, late_rows=300)
    before_target = _count(conn, "outbox")
    assert before_target == 800  # 500 old + 300 published after the swap
    result, verification = copy_back(conn, spec, UNTHROTTLED, dsn=dsn)
    assert result.inserted_rows == 20_000
    assert result.present_rows == 0
    assert verification is not None and verification.passed
    # The late rows share the source's id range; verification must not count them.
    assert verification.source_rows == verification.matched_rows == 20_000
    assert not _exists(conn, "outbox_published")
    assert _count(conn, "outbox") == before_target + 20_000
    # Reachable through the partitioned table, as the application sees it.
    assert _count(conn, "outbox_new") == before_target + 20_000
    # A second run finds the recorded, finished job and does nothing.
    again = CopyBack(conn, spec, UNTHROTTLED, dsn=dsn)
    assert again.plan().state == "done"
    assert again.run().inserted_rows == 0


def test_killed_mid_copy_resumes_from_high_water_mark(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    build_after_v4(conn, old_rows=100, published_rows=60_000)
    args = ("copy-back", "--dsn", dsn, "--batch-size", "500", "--rate", "15000",
            "--no-adaptive", "--format", "json")  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_migrate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        mark = None
        while time.monotonic() < deadline:
            if _exists(conn, "outbox_migrate.copy_back_progress"):
                row = conn.execute(
                    "SELECT high_water, rows_inserted FROM outbox_migrate.copy_back_progress"
                ).fetchone()
                if row and row[1] and row[1] >= 10_000:
                    mark = row
                    break
            time.sleep(0.05)
        assert mark is not None, "the copy never got going"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    high_water, inserted = conn.execute(
        "SELECT high_water, rows_inserted FROM outbox_migrate.copy_back_progress"
    ).fetchone()  # type: ignore[misc]
    copied = _count(conn, "outbox") - 100
    assert 0 < copied < 60_000, "the kill did not land mid-copy"
    # The mark commits with its batch: it covers exactly the rows in the target.
    assert inserted == copied
    max_copied = conn.execute(
        "SELECT max(id) FROM outbox WHERE id IN (SELECT id FROM outbox_published)"
    ).fetchone()[0]  # type: ignore[index]
    assert high_water == max_copied

    rerun = _cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    report = json.loads(rerun.stdout)
    assert report["copy"]["resumed_from"] == high_water
    assert report["copy"]["inserted_rows"] == 60_000 - copied
    assert report["copy"]["present_rows"] == 0  # resumed after the mark, not from the start
    assert report["verification"]["passed"] is True
    assert report["dropped"] is True
    assert _count(conn, "outbox") == 60_100
    assert not _exists(conn, "outbox_published")


def test_corrupted_rows_are_named_and_the_drop_is_refused(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    spec = build_after_v4(conn, old_rows=10, published_rows=30_000)
    options = CopyBackOptions(verify_range_ids=10_000, throttle=ThrottlePolicy(adaptive=False))
    job = CopyBack(conn, spec, options, dsn=dsn)
    job.run()
    assert job.verify().passed
    low = conn.execute("SELECT min(id) FROM outbox_published").fetchone()[0]  # type: ignore[index]
    changed, missing = low + 12_345, low + 25_000
    conn.execute("UPDATE outbox SET payload = '{\"tampered\": true}' WHERE id = %s", (changed,))
    conn.execute("DELETE FROM outbox WHERE id = %s", (missing,))

    verification = job.verify()
    assert not verification.passed
    assert verification.ranges_checked == 3
    ranges = {(r.low, r.high) for r in verification.differing}
    assert ranges == {(low + 10_000, low + 20_000), (low + 20_000, low + 30_000)}
    assert verification.matched_rows == 30_000 - 1
    with pytest.raises(VerificationFailed, match=rf"ids \[{low + 10_000}, {low + 20_000}\)"):
        job.drop(verification)
    assert _exists(conn, "outbox_published")

    # The CLI says the same in one line, exits 1 and keeps the source.
    result = _cli("copy-back", "--dsn", dsn, "--no-adaptive")
    assert result.returncode == 1
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("outbox-migrate: error")]
    assert len(errors) == 1
    assert f"ids [{low}, {low + 100_000}) (29999 of 30000 rows present)" in errors[0]
    assert "was not dropped" in errors[0]
    assert _exists(conn, "outbox_published")

    # --from-start re-copies the deleted row; the changed one is still named, still kept.
    result = _cli("copy-back", "--dsn", dsn, "--no-adaptive", "--from-start", "--format", "json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert (report["copy"]["inserted_rows"], report["copy"]["present_rows"]) == (1, 29_999)
    assert report["verification"]["matched_rows"] == 30_000
    assert report["verification"]["differing_ranges"] == [
        f"ids [{low}, {low + 100_000}) (rows differ)"
    ]
    assert _exists(conn, "outbox_published")


def test_rows_already_in_the_target_are_skipped_not_duplicated(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    spec = build_after_v4(conn, old_rows=10, published_rows=5_000)
    # A copy made by other means (or a lost progress table): half the rows already there.
    conn.execute(
        "INSERT INTO outbox OVERRIDING SYSTEM VALUE"
        " SELECT * FROM outbox_published ORDER BY id LIMIT 2500"
    )
    result, verification = copy_back(conn, spec, UNTHROTTLED, dsn=dsn, drop=False)
    assert (result.inserted_rows, result.present_rows) == (2_500, 2_500)
    assert verification is not None and verification.passed
    assert _exists(conn, "outbox_published")  # drop=False keeps it
    assert _count(conn, "outbox") == 5_010


def test_refuses_a_source_that_is_still_attached(conn: psycopg.Connection[Any]) -> None:
    from outbox_migrate_harness.testing.schema import create_flat_outbox, create_partitioned_outbox

    create_flat_outbox(conn)
    create_partitioned_outbox(conn, start=1_000_000)
    with pytest.raises(CopyBackError, match="still a partition"):
        CopyBack(conn, OutboxSpec()).plan()


def test_missing_source_without_record_is_a_schema_error(conn: psycopg.Connection[Any]) -> None:
    from outbox_migrate_harness.testing.schema import create_flat_outbox

    create_flat_outbox(conn)
    with pytest.raises(SchemaError, match="does not exist"):
        CopyBack(conn, OutboxSpec()).plan()


def test_drop_refuses_a_source_changed_after_verification(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    spec = build_after_v4(conn, old_rows=10, published_rows=1_000)
    job = CopyBack(conn, spec, UNTHROTTLED, dsn=dsn)
    job.run()
    verification = job.verify()
    assert verification.passed
    conn.execute(
        "INSERT INTO outbox_published (id, payload, published_at) OVERRIDING SYSTEM VALUE"
        " VALUES (99999999, '{}', now())"
    )
    with pytest.raises(CopyBackError, match="changed since verification"):
        job.drop(verification)
    assert _exists(conn, "outbox_published")


def test_custom_names_come_from_the_spec(conn: psycopg.Connection[Any], dsn: str) -> None:
    spec = OutboxSpec(
        schema="billing",
        table="events",
        partitioned_table="events_p",
        unpublished_partition="events_todo",
        published_partition="events_done",
        id_column="event_id",
        published_column="sent_at",
    )
    build_after_v4(conn, old_rows=5, published_rows=2_000, late_rows=10, spec=spec)
    result, verification = copy_back(conn, spec, UNTHROTTLED, dsn=dsn)
    assert result.inserted_rows == 2_000
    assert verification is not None and verification.passed
    assert not _exists(conn, "billing.events_done")
    total = conn.execute("SELECT count(*) FROM billing.events").fetchone()[0]  # type: ignore[index]
    assert total == 2_015


@pytest.mark.newest_pg_only  # throttling/CLI logic, not server behaviour
def test_rate_ceiling_holds(conn: psycopg.Connection[Any], dsn: str) -> None:
    spec = build_after_v4(conn, old_rows=10, published_rows=4_000)
    policy = ThrottlePolicy(adaptive=False, rate_rows_per_s=4_000)
    job = CopyBack(conn, spec, CopyBackOptions(batch_rows=500, throttle=policy), dsn=dsn)
    started = time.monotonic()
    result = job.run()
    elapsed = time.monotonic() - started
    assert result.inserted_rows == 4_000
    # 4 000 rows at 4 000 rows/s: the last batch is due at 1 s.
    assert elapsed >= 0.95
    assert result.paused_s > 0.5


@pytest.mark.newest_pg_only  # throttling/CLI logic, not server behaviour
def test_a_stuck_foreground_query_makes_the_copy_back_off(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    spec = build_after_v4(conn, old_rows=10, published_rows=20_000)
    # Short pauses keep the test quick whatever else loads the machine.
    policy = ThrottlePolicy(max_pause_s=0.25)
    job = CopyBack(conn, spec, CopyBackOptions(batch_rows=200, throttle=policy), dsn=dsn)
    impacts: list[Any] = []
    locker = psycopg.connect(dsn)
    release = threading.Timer(1.5, locker.rollback)

    def progress(p: Any) -> None:
        impacts.append(p.impact)
        if len(impacts) == 5:
            # The relay's table is locked: the probe's query (like the relay's) is stuck.
            locker.execute("LOCK TABLE outbox_unpublished IN ACCESS EXCLUSIVE MODE")
            release.start()

    try:
        result = job.run(progress=progress)
    finally:
        release.cancel()
        locker.close()
    assert result.inserted_rows == 20_000
    over = [i for i in impacts if i is not None and i.over]
    assert over, "the stuck probe was never seen"
    assert {i.source for i in over} == {"latency_probe"}
    assert result.paused_s >= 0.5  # the lock lasted 1.5 s; pauses of up to 0.25 s each


@pytest.mark.newest_pg_only  # throttling/CLI logic, not server behaviour
def test_cli_shows_rows_rate_and_eta(conn: psycopg.Connection[Any], dsn: str) -> None:
    build_after_v4(conn, old_rows=10, published_rows=3_000)
    result = _cli("copy-back", "--dsn", dsn, "--batch-size", "500", "--rate", "6000")
    assert result.returncode == 0, result.stderr
    assert "3,000/3,000" in result.stderr or "3000/3000" in result.stderr
    assert "rows/s" in result.stderr and "ETA" in result.stderr
    assert "copied 3,000 rows" in result.stdout
    assert "dropped public.outbox_published" in result.stdout


@pytest.mark.newest_pg_only  # throttling/CLI logic, not server behaviour
def test_a_second_copier_is_refused(conn: psycopg.Connection[Any], dsn: str) -> None:
    spec = build_after_v4(conn, old_rows=10, published_rows=1_000)
    job = CopyBack(conn, spec, UNTHROTTLED, dsn=dsn)
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(hashtext(%s))", (job.lock_key,))
        with pytest.raises(RunnerBusy, match="another copy-back"):
            job.run()
        result = _cli("copy-back", "--dsn", dsn, "--no-adaptive")
        assert result.returncode == 3, result.stderr
        # Released by the holder, not by its disconnect: the server ends a closed session's
        # backend a moment after the client hangs up, later still on a loaded machine.
        other.execute("SELECT pg_advisory_unlock(hashtext(%s))", (job.lock_key,))
    assert job.run().inserted_rows == 1_000  # free again


def test_uuid_ids_copy_in_keyset_batches_resume_and_verify_by_rows(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    """Application ids (uuid): no min()/max(), no id arithmetic. Batches walk the uuid order
    from no lower bound, the high-water mark is kept as text and resumed from, verification
    ranges are `verify_range_ids` rows each (the last unbounded), and a changed row is named
    by its uuid range and refuses the drop."""
    conn.execute(
        "CREATE TABLE outbox_u (id uuid PRIMARY KEY, payload jsonb NOT NULL, "
        "published_at timestamptz);"
        "CREATE TABLE outbox_u_published (LIKE outbox_u);"
        "INSERT INTO outbox_u_published SELECT gen_random_uuid(), jsonb_build_object('n', n), "
        "now() FROM generate_series(1, 2500) n;"
        # rows an interrupted earlier run already copied
        "INSERT INTO outbox_u SELECT * FROM outbox_u_published ORDER BY id LIMIT 300"
    )
    spec = OutboxSpec(
        table="outbox_u", partitioned_table="outbox_u_new",
        unpublished_partition="outbox_u_unpublished", published_partition="outbox_u_published",
        id_kind="application",
    )  # fmt: skip
    options = CopyBackOptions(
        batch_rows=400, verify_range_ids=700, throttle=ThrottlePolicy(adaptive=False)
    )
    stop = threading.Event()
    seen: list[Any] = []

    def progress(p: Any) -> None:
        seen.append(p.high_water)
        if len(seen) == 2:
            stop.set()

    job = CopyBack(conn, spec, options, dsn=dsn)
    first = job.run(progress=progress, stop=stop)
    assert first.stopped and first.batches == 2
    assert isinstance(first.high_water, str) and first.high_water == seen[-1]
    assert (first.inserted_rows, first.present_rows) == (500, 300)
    lowest_800 = conn.execute(
        "SELECT max(id::text) FROM (SELECT id FROM outbox_u_published ORDER BY id LIMIT 800) x"
    ).fetchone()
    assert lowest_800 == (first.high_water,)
    plan = CopyBack(conn, spec, options, dsn=dsn).plan()
    assert plan.high_water == first.high_water and plan.remaining_rows == 1700
    second = CopyBack(conn, spec, options, dsn=dsn).run()
    assert second.resumed_from == first.high_water
    assert (second.inserted_rows, second.present_rows, second.stopped) == (1700, 0, False)
    assert _count(conn, "outbox_u") == 2500

    conn.execute(
        "UPDATE outbox_u SET payload = '{\"n\": -1}' "
        "WHERE id = (SELECT id FROM outbox_u ORDER BY id OFFSET 1500 LIMIT 1)"
    )
    failed = CopyBack(conn, spec, options, dsn=dsn).verify()
    assert not failed.passed and failed.ranges_checked == 4  # 700 + 700 + 700 + 400 rows
    assert len(failed.differing) == 1 and failed.differing[0].source_rows == 700
    with pytest.raises(VerificationFailed, match="rows differ"):
        CopyBack(conn, spec, options, dsn=dsn).drop(failed)
    conn.execute(
        "UPDATE outbox_u o SET payload = p.payload FROM outbox_u_published p WHERE p.id = o.id"
    )
    _, verification = copy_back(conn, spec, options, dsn=dsn)
    assert verification is not None and verification.passed
    assert verification.source_rows == verification.matched_rows == 2500
    assert not _exists(conn, "outbox_u_published")


def test_the_plain_sql_loop_copies_uuid_ids(conn: psycopg.Connection[Any]) -> None:
    """The copy-back step's SQL shown for manual runs works for application ids too (no
    max(uuid), no bigint mark)."""
    from outbox_migrate.patterns import build_pattern

    conn.execute(
        "CREATE TABLE outbox_u (id uuid PRIMARY KEY, payload jsonb NOT NULL, "
        "published_at timestamptz);"
        "CREATE TABLE outbox_u_published (LIKE outbox_u);"
        "INSERT INTO outbox_u_published SELECT gen_random_uuid(), jsonb_build_object('n', n), "
        "now() FROM generate_series(1, 25000) n;"
        "INSERT INTO outbox_u SELECT * FROM outbox_u_published LIMIT 10"
    )
    spec = OutboxSpec(table="outbox_u", published_partition="outbox_u_published",
                      id_kind="application")  # fmt: skip
    step = next(s for s in build_pattern("hoper", spec).steps() if s.kind == "copy-back")
    conn.execute(step.statements[0])
    missing = conn.execute(
        "SELECT count(*) FROM outbox_u_published p "
        "WHERE NOT EXISTS (SELECT FROM outbox_u o WHERE o.id = p.id)"
    ).fetchone()
    assert missing == (0,) and _count(conn, "outbox_u") == 25000


def test_from_start_is_an_option_of_the_job_the_runner_honours(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    """`copy-back --from-start` was the CLI's alone: with the migration in the ledger the
    command runs the runner's copy-back step, which resumed from the high-water mark, so a row
    deleted from the target below it was never copied again (drop refused for ever)."""
    spec = build_after_v4(conn, old_rows=10, published_rows=2_000, late_rows=10)
    copy_back(conn, spec, UNTHROTTLED, dsn=dsn, drop=False)
    low = conn.execute("SELECT min(id) FROM outbox_published").fetchone()[0]  # type: ignore[index]
    conn.execute("DELETE FROM outbox WHERE id = %s", (low + 7,))
    with pytest.raises(VerificationFailed, match="1999 of 2000 rows present"):
        copy_back(conn, spec, UNTHROTTLED, dsn=dsn, drop=False)  # what the runner's step did
    again = CopyBackOptions(throttle=ThrottlePolicy(adaptive=False), from_start=True)
    result, verification = copy_back(conn, spec, again, dsn=dsn, drop=False)
    assert result.inserted_rows == 1
    assert verification is not None and verification.passed
