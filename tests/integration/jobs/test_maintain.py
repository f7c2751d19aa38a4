"""Maintenance on a real server: the spec's bloat observation, REINDEX under a live writer,
the guards around it, autovacuum settings and retention."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_partitioned_outbox, insert_rows

from outbox_migrate.config import OutboxSpec
from outbox_migrate.jobs import maintain, reindex
from outbox_migrate.jobs.common import Relation
from outbox_migrate.jobs.maintain import MaintenanceOptions, find_partitions, maintain_once

SPEC = OutboxSpec()
UNPUBLISHED = Relation("public", "outbox_unpublished")


def _bloated_outbox(conn: psycopg.Connection[Any]) -> None:
    """The spec's observation: 100 k rows inserted, then every one of them published."""
    create_partitioned_outbox(conn)
    insert_rows(conn, "outbox_new", 100_000)
    conn.execute("UPDATE outbox_new SET published_at = now() WHERE published_at IS NULL")


class Writer(threading.Thread):
    """The application: inserts one outbox row per transaction, as fast as it can, timing
    each insert (its own connection, autocommit)."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.samples: list[tuple[float, float]] = []  # (start, latency s)
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    t0 = time.monotonic()
                    conn.execute("INSERT INTO outbox_new (payload) VALUES ('{\"live\": true}')")
                    self.samples.append((t0, time.monotonic() - t0))
        except BaseException as exc:  # reported by the test
            self.error = exc

    def between(self, start: float, end: float) -> list[float]:
        return [lat for t, lat in self.samples if start <= t <= end]


@pytest.mark.parametrize("method", ["pgstattuple", "estimate"])
def test_spec_bloat_observation_then_reindex_under_a_live_writer(
    conn: psycopg.Connection[Any], dsn: str, method: str
) -> None:
    _bloated_outbox(conn)
    only_measure = MaintenanceOptions(bloat_method=method, reindex=False)  # type: ignore[arg-type]
    [index] = maintain_once(conn, SPEC, only_measure).indexes
    assert index.index == SPEC.unpublished_index
    assert index.before.method == method
    assert index.before.bloat_pct >= 90.0, index.before  # the spec: ~99 %
    assert index.status == "skipped"
    # The spec's next step: 10 k new rows reuse a few pages; the index stays ~90 % bloat.
    insert_rows(conn, "outbox_new", 10_000)
    [index] = maintain_once(conn, SPEC, only_measure).indexes
    assert index.before.bloat_pct >= 85.0, index.before

    writer = Writer(dsn)
    writer.start()
    try:
        time.sleep(0.3)  # a baseline with no maintenance running
        t0 = time.monotonic()
        report = maintain_once(conn, SPEC, MaintenanceOptions(bloat_method=method))  # type: ignore[arg-type]
        time.sleep(0.2)
    finally:
        writer.stop.set()
        writer.join(timeout=10)
    assert writer.error is None, writer.error
    [index] = report.indexes
    assert index.status == "reindexed", index.message
    assert index.after is not None and index.window is not None
    assert index.after.bloat_pct < MaintenanceOptions().bloat_threshold_pct
    assert index.after.size_bytes < index.before.size_bytes / 3
    baseline = writer.between(0, t0)
    during = writer.between(index.window[0] - 0.001, index.window[1])
    assert baseline and during, "the writer made no insert while REINDEX ran"
    # Never blocked: REINDEX CONCURRENTLY holds no lock that conflicts with INSERT.
    assert max(during) < 1.0, f"an insert waited {max(during):.3f}s during REINDEX"
    print(
        f"\n[{method}] writer insert latency, ms: without maintenance p50"
        f" {statistics.median(baseline) * 1000:.2f} max {max(baseline) * 1000:.2f};"
        f" during REINDEX ({index.seconds * 1000:.0f} ms, {len(during)} inserts) p50"
        f" {statistics.median(during) * 1000:.2f} max {max(during) * 1000:.2f}"
    )
    # Every insert the writer made is found through the rebuilt index.
    conn.execute("SET enable_seqscan = off")
    count = conn.execute("SELECT count(*) FROM outbox_unpublished WHERE id > 0").fetchone()[0]  # type: ignore[index]
    assert count == 10_000 + len(writer.samples)


def test_refuses_to_reindex_while_an_old_transaction_is_open(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    _bloated_outbox(conn)
    with psycopg.connect(dsn, application_name="long-report") as old:
        old.execute("SELECT count(*) FROM outbox_new")  # holds a snapshot, transaction open
        time.sleep(0.6)
        options = MaintenanceOptions(max_xact_age_s=0.5)
        report = maintain_once(conn, SPEC, options)
        [index] = report.indexes
        assert index.status == "refused"
        assert f"pid {old.info.backend_pid} (long-report)" in index.message
        assert report.problems == [index.message]
        # The same through the CLI: one line, exit code 5 (a precondition does not hold).
        result = subprocess.run(
            [sys.executable, "-m", "outbox_migrate", "maintain", "--once", "--dsn", dsn,
             "--max-xact-age", "0.5", "--format", "json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 5, result.stderr
        assert json.loads(result.stdout)["indexes"][0]["status"] == "refused"
        assert "long-report" in result.stderr
    # Nothing was started: no leftover, the index is as bloated as before.
    assert reindex.leftover_indexes(conn, UNPUBLISHED) == []
    after = maintain_once(conn, SPEC, MaintenanceOptions(reindex=False))
    assert after.indexes[0].before.bloat_pct >= 90.0


def test_a_failed_reindex_leaves_no_invalid_index_behind(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    _bloated_outbox(conn)
    writer = psycopg.connect(dsn)
    try:
        # A young write transaction: not old enough to refuse, but REINDEX CONCURRENTLY must
        # wait for it, and our lock_timeout is shorter than it lasts.
        writer.execute("INSERT INTO outbox_new (payload) VALUES ('{}')")
        release = threading.Timer(1.0, writer.commit)
        release.start()
        options = MaintenanceOptions(reindex_lock_timeout_ms=200)
        report = maintain_once(conn, SPEC, options)
        release.join()
    finally:
        writer.close()
    [index] = report.indexes
    assert index.status == "failed"
    assert "lock timeout" in index.message
    assert "dropped leftover" in index.message and "_ccnew" in index.message
    assert reindex.leftover_indexes(conn, UNPUBLISHED) == []
    valid = conn.execute(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = %s::regclass", (SPEC.unpublished_index,)
    ).fetchone()[0]  # type: ignore[index]
    assert valid is True
    # The next pass rebuilds it.
    assert maintain_once(conn, SPEC).indexes[0].status == "reindexed"


def test_a_leftover_from_a_crashed_reindex_is_dropped_before_the_next_one(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    _bloated_outbox(conn)
    blocker = psycopg.connect(dsn)
    blocker.execute("INSERT INTO outbox_new (payload) VALUES ('{}')")
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SET lock_timeout = '300ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            other.execute("REINDEX INDEX CONCURRENTLY outbox_new_unpublished_id_idx")
    blocker.commit()
    blocker.close()
    assert reindex.leftover_indexes(conn, UNPUBLISHED) == ["outbox_new_unpublished_id_idx_ccnew"]
    report = maintain_once(conn, SPEC)
    assert report.indexes[0].status == "reindexed"
    assert reindex.leftover_indexes(conn, UNPUBLISHED) == []


def test_autovacuum_settings_are_applied_to_the_default_partition_and_checked(
    conn: psycopg.Connection[Any],
) -> None:
    create_partitioned_outbox(conn)
    published = find_partitions(conn, SPEC).published
    assert published == Relation("public", "outbox_published")
    expected = maintain.published_settings(100_000)
    unchanged = maintain_once(conn, SPEC, MaintenanceOptions(apply_autovacuum=False))
    [check] = unchanged.autovacuum
    assert not check.ok
    assert unchanged.problems  # settings differing is reported
    applied = maintain_once(conn, SPEC)
    [check] = applied.autovacuum
    assert check.applied and check.ok
    assert maintain.autovacuum_settings(conn, published) == expected
    again = maintain_once(conn, SPEC)
    [check] = again.autovacuum
    assert check.ok and not check.applied
    assert again.problems == []
    # The unpublished partition keeps the defaults (small and churning: they suit it).
    assert maintain.autovacuum_settings(conn, UNPUBLISHED) == {}


def test_retention_deletes_only_rows_published_before_the_cutoff(
    conn: psycopg.Connection[Any],
) -> None:
    create_partitioned_outbox(conn)
    insert_rows(conn, "outbox_new", 30_000, published=True)
    conn.execute(
        "UPDATE outbox_published SET published_at = now() - interval '10 days' WHERE id <= 20000"
    )
    insert_rows(conn, "outbox_new", 500)  # unpublished: never touched
    options = MaintenanceOptions(
        retention=timedelta(days=7), retention_batch_blocks=50, reindex=False
    )
    report = maintain_once(conn, SPEC, options)
    assert report.retention is not None and report.retention.skipped is None
    assert report.retention.deleted_rows == 20_000
    assert report.retention.batches > 1
    left = conn.execute(
        "SELECT count(*) FILTER (WHERE published_at IS NULL),"
        " count(*) FILTER (WHERE published_at < now() - interval '7 days'), count(*)"
        " FROM outbox_new"
    ).fetchone()
    assert left == (500, 0, 10_500)


def test_retention_waits_for_a_pending_copy_back(conn: psycopg.Connection[Any], dsn: str) -> None:
    from outbox_migrate_harness.testing.schema import build_after_v4

    from outbox_migrate.jobs.copy_back import CopyBack, CopyBackOptions
    from outbox_migrate.jobs.throttle import ThrottlePolicy

    spec = build_after_v4(conn, old_rows=1_000, published_rows=1_000)
    conn.execute("UPDATE outbox SET published_at = now() - interval '30 days'")
    CopyBack(conn, spec, CopyBackOptions(throttle=ThrottlePolicy(adaptive=False))).run()
    options = MaintenanceOptions(retention=timedelta(days=7), reindex=False)
    report = maintain_once(conn, spec, options)
    assert report.published == "public.outbox"  # the old table is the DEFAULT partition now
    assert report.retention is not None
    assert report.retention.skipped is not None and "copy-back" in report.retention.skipped
    assert conn.execute("SELECT count(*) FROM outbox").fetchone()[0] == 2_000  # type: ignore[index]


def _time_partitioned_outbox(conn: psycopg.Connection[Any], *, with_default: bool) -> None:
    """The spec's layout, with the published DEFAULT partition itself RANGE-partitioned by
    publication month (two old months and the current one prepared)."""
    conn.execute(
        "CREATE TABLE outbox_new (id int8 GENERATED ALWAYS AS IDENTITY,"
        " event_type text NOT NULL DEFAULT 'event', message_key text, payload json NOT NULL,"
        " created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz)"
        " PARTITION BY LIST (published_at)"
    )
    conn.execute("CREATE TABLE outbox_unpublished PARTITION OF outbox_new FOR VALUES IN (NULL)")
    conn.execute("CREATE INDEX outbox_new_unpublished_id_idx ON outbox_unpublished (id)")
    conn.execute(
        "CREATE TABLE outbox_published PARTITION OF outbox_new DEFAULT"
        " PARTITION BY RANGE (published_at)"
    )
    conn.execute("SET TimeZone = 'UTC'")
    for months_ago in (3, 2, 0):
        conn.execute(
            psycopg.sql.SQL(
                "CREATE TABLE {} PARTITION OF outbox_published FOR VALUES FROM ({}) TO ({})"
            ).format(
                psycopg.sql.Identifier(f"outbox_published_m{months_ago}"),
                psycopg.sql.Literal(f"{_month_start(conn, -months_ago)}"),
                psycopg.sql.Literal(f"{_month_start(conn, -months_ago + 1)}"),
            )
        )
    if with_default:
        conn.execute("CREATE TABLE outbox_published_other PARTITION OF outbox_published DEFAULT")
    # Rows published 80 and 70 days ago, and now; some still unpublished.
    for days in (80, 70, 0):
        insert_rows(conn, "outbox_new", 1_000)
        conn.execute(
            "UPDATE outbox_new SET published_at = now() - make_interval(days => %s)"
            " WHERE published_at IS NULL",
            (days,),
        )
    insert_rows(conn, "outbox_new", 100)


def _month_start(conn: psycopg.Connection[Any], offset: int) -> str:
    row = conn.execute(
        "SELECT (date_trunc('month', now() AT TIME ZONE 'UTC')"
        " + make_interval(months => %s))::text || '+00'",
        (offset,),
    ).fetchone()
    return str(row[0])  # type: ignore[index]


@pytest.mark.parametrize("with_default", [False, True], ids=["concurrently", "default-sub"])
def test_retention_drops_expired_time_partitions_and_creates_ahead(
    conn: psycopg.Connection[Any], with_default: bool
) -> None:
    _time_partitioned_outbox(conn, with_default=with_default)
    options = MaintenanceOptions(retention=timedelta(days=45), reindex=False)
    report = maintain_once(conn, SPEC, options)
    result = report.time_partitions
    assert result is not None and result.busy == []
    assert report.retention is None  # no row-by-row deletes
    # Months entirely older than 45 days are gone (3 and 2 months ago end before the cutoff
    # whatever today's date); rows published 70 and 80 days ago went with them.
    assert "public.outbox_published_m3" in result.dropped
    remaining = conn.execute(
        "SELECT count(*) FILTER (WHERE published_at IS NULL),"
        " count(*) FILTER (WHERE published_at > now() - interval '1 day'),"
        " count(*) FILTER (WHERE published_at < now() - interval '75 days') FROM outbox_new"
    ).fetchone()
    assert remaining == (100, 1_000, 0)
    # The next two months exist now, and every leaf carries the spec's autovacuum settings.
    leaves = {c.table for c in report.autovacuum}
    assert len(result.created) == 2
    assert set(result.created) <= leaves
    assert all(c.ok for c in report.autovacuum)
    # Publishing keeps working into the current month; a second pass changes nothing.
    conn.execute("UPDATE outbox_new SET published_at = now() WHERE published_at IS NULL")
    again = maintain_once(conn, SPEC, options).time_partitions
    assert again is not None and again.created == [] and again.dropped == []


@pytest.mark.newest_pg_only  # the CLI's loop, not server behaviour
def test_loop_mode_reports_every_interval_and_stops_on_sigterm(
    conn: psycopg.Connection[Any], dsn: str
) -> None:
    import signal

    create_partitioned_outbox(conn)
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_migrate", "maintain", "--dsn", dsn, "--interval", "1",
         "--format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        second = json.loads(proc.stdout.readline())
        assert first["autovacuum"][0]["applied"] is True
        assert second["autovacuum"][0]["applied"] is False  # already in place
        assert second["problems"] == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_loop_mode_finishes_the_reindex_in_flight_on_a_signal(
    conn: psycopg.Connection[Any], dsn: str, signame: str
) -> None:
    """docs/cli.md: `maintain` in loop mode treats SIGINT like SIGTERM, as its normal stop —
    the pass in flight finishes, exit 0. A Ctrl-C that cancelled the REINDEX CONCURRENTLY
    instead left its invalid `_ccnew` index behind."""
    import signal

    _bloated_outbox(conn)
    writer = psycopg.connect(dsn)  # a young write transaction the REINDEX must wait for
    writer.execute("INSERT INTO outbox_new (payload) VALUES ('{}')")
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_migrate", "maintain", "--dsn", dsn, "--interval", "60",
         "--format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not conn.execute(
            "SELECT FROM pg_stat_activity WHERE query ILIKE 'REINDEX%%' AND wait_event_type = 'Lock'"
        ).fetchall():
            assert time.monotonic() < deadline and proc.poll() is None, "REINDEX never waited"
            time.sleep(0.05)
        proc.send_signal(getattr(signal, signame))
        time.sleep(0.5)
        writer.commit()  # the REINDEX goes on, well within its lock timeout
        out, err = proc.communicate(timeout=60)
    finally:
        writer.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert out, "no report: the pass in flight did not finish"
    assert json.loads(out.splitlines()[0])["indexes"][0]["status"] == "reindexed"
    assert reindex.leftover_indexes(conn, UNPUBLISHED) == []
