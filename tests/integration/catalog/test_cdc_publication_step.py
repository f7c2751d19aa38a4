"""CDC users migrating (issue 18) on real PostgreSQL: the conditional step carries the flat
outbox's publication to the unpublished partition before V2 writes there, a mark still works
under publications of UPDATE/DELETE, rollback removes only what the migration added, and
`plan` shows the step and the consumer's view in every format."""

from __future__ import annotations

import json

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from outbox_migrate_harness.testing.server import Server

from outbox_migrate.config import load_settings
from outbox_migrate.plan import split_sql_phases
from outbox_migrate.runner import Runner
from tests.support.alembic_project import psql
from tests.support.app import publish_all
from tests.support.cli import run_cli

SETTINGS = load_settings({"gate_window_s": 0.05, "lock_budget_s": 10.0}, environ={})


def members(conn: psycopg.Connection, publication: str) -> list[tuple[str, str | None]]:
    """(relation, row filter) of each table the publication lists."""
    filtered = "pg_get_expr(r.prqual, r.prrelid)" if conn.info.server_version >= 150000 else "NULL"
    return [
        (str(r[0]), r[1])
        for r in conn.execute(
            f"SELECT r.prrelid::regclass::text, {filtered} FROM pg_publication_rel r "
            "JOIN pg_publication p ON p.oid = r.prpubid WHERE p.pubname = %s ORDER BY 1",
            (publication,),
        ).fetchall()
    ]


@pytest.mark.parametrize("pattern", ["hop", "hoper", "hopia"])
def test_v2_adds_the_partition_and_rollback_removes_only_that(dsn: str, pattern: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        conn.execute("CREATE PUBLICATION dbz FOR TABLE outbox")
        with Runner(dsn, SETTINGS, pattern) as runner:
            runner.run("V2")
        assert members(conn, "dbz") == [("outbox", None), ("outbox_unpublished", None)]
        # the application of V2 inserts and the relay marks (a cross-partition UPDATE) under
        # a publication of UPDATE/DELETE: without the replica identity the mark fails
        insert_rows(conn, "outbox_new", 3)
        assert publish_all(conn, "outbox_new") == 3
        with Runner(dsn, SETTINGS, pattern) as runner:
            ids = [s.id for s in runner.pattern.phase("V2").steps]
            target = f"{pattern}.v2.publish-unpublished-partition"
            for step_id in reversed(ids[ids.index(target) :]):  # newest first, as rollback
                assert runner.reverse_step(step_id)
        assert members(conn, "dbz") == [("outbox", None)]
        row = conn.execute(
            "SELECT relreplident FROM pg_class WHERE oid = 'outbox_unpublished'::regclass"
        ).fetchone()
        assert row == ("d",)


def test_a_membership_added_by_hand_is_not_taken_over(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        conn.execute("CREATE PUBLICATION dbz FOR TABLE outbox")
        with Runner(dsn, SETTINGS, "hoper") as runner:
            runner.run("V2")
            runner.rollback("V1")
        assert members(conn, "dbz") == [("outbox", None)]
        assert conn.execute("SELECT to_regclass('outbox_new')").fetchone() == (None,)


def test_a_row_filter_and_column_list_are_carried(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.info.server_version < 150000:
            pytest.skip("row filters and column lists need PostgreSQL 15")
        create_flat_outbox(conn)
        conn.execute(
            "CREATE PUBLICATION dbz FOR TABLE outbox (id, payload, published_at) "
            "WHERE (id > 5) WITH (publish = 'insert')"
        )
        with Runner(dsn, SETTINGS, "hopia") as runner:
            runner.run("V2")
        assert members(conn, "dbz") == [("outbox", "(id > 5)"), ("outbox_unpublished", "(id > 5)")]
        columns = conn.execute(
            "SELECT attnames FROM pg_publication_tables WHERE pubname = 'dbz' "
            "AND tablename = 'outbox_unpublished'"
        ).fetchone()
        assert columns is not None and sorted(columns[0]) == ["id", "payload", "published_at"]


def test_for_all_tables_needs_only_the_replica_identity(dsn: str) -> None:
    """Before issue 18 every mark failed under a FOR ALL TABLES publication: the partitions had
    no replica identity and the publication publishes UPDATE and DELETE."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        conn.execute("CREATE PUBLICATION everything FOR ALL TABLES")
        try:
            with Runner(dsn, SETTINGS, "hop") as runner:
                runner.run("V2")
            insert_rows(conn, "outbox_new", 3)
            assert publish_all(conn, "outbox_new") == 3
            assert conn.execute("DELETE FROM outbox_published").rowcount == 3
        finally:
            conn.execute("DROP PUBLICATION everything")


def test_plan_shows_the_step_and_the_consumer_view(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        conn.execute("CREATE PUBLICATION dbz FOR TABLE outbox")
    base = ["plan", "--pattern", "hoper", "--dsn", dsn]
    as_json = run_cli(*base, "--format", "json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    v2 = next(p for p in doc["phases"] if p["name"] == "V2")
    assert "hoper.v2.publish-unpublished-partition" in [s["id"] for s in v2["steps"]]
    assert v2["cdc"][0]["messages_on"] == ["outbox", "outbox_unpublished"]
    text = run_cli(*base)
    assert text.returncode == 0, text.stderr
    assert "CDC dbz: new messages arrive as INSERT on outbox, outbox_unpublished" in text.stdout
    as_sql = run_cli(*base, "--format", "sql")
    assert 'ALTER PUBLICATION "dbz" ADD TABLE "public"."outbox_unpublished";' in as_sql.stdout
    markdown = run_cli(*base, "--format", "markdown")
    assert "emit an INSERT only when published_at IS NULL" in markdown.stdout


def test_the_step_stays_what_ran_when_the_publication_changes_later(dsn: str) -> None:
    """The runner builds the CDC step from the publications recorded when the migration
    started: a publication altered after V2 neither changes the done step's checksum (which
    the runner would refuse as a catalog change) nor makes it vanish from status."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        conn.execute("CREATE PUBLICATION dbz FOR TABLE outbox")
        with Runner(dsn, SETTINGS, "hop") as runner:
            runner.run("V2")
        conn.execute("ALTER PUBLICATION dbz SET (publish = 'insert')")
        publish_all(conn, "outbox")
        with Runner(dsn, SETTINGS, "hop") as runner:
            runner.run("V3")
            steps = {s["id"]: s["state"] for s in runner.status()["steps"]}
            assert runner.verify() == []
        assert steps["hop.v2.publish-unpublished-partition"] == "done"
        assert steps["hop.v3.gate-old-table-retired"] == "done"


def test_tables_in_schema_is_covered_like_all_tables(dsn: str) -> None:
    """PostgreSQL 15+: a schema publication covers the new partitions by itself (nothing is
    added) and, publishing UPDATE/DELETE, needs their replica identity for marks and
    retention."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.info.server_version < 150000:
            pytest.skip("TABLES IN SCHEMA needs PostgreSQL 15")
        create_flat_outbox(conn)
        conn.execute("CREATE PUBLICATION by_schema FOR TABLES IN SCHEMA public")
        with Runner(dsn, SETTINGS, "hoper") as runner:
            step = runner.step("hoper.v2.publish-unpublished-partition")
            runner.run("V2")
        assert step.creates == ()
        assert members(conn, "by_schema") == []
        insert_rows(conn, "outbox_new", 3)
        assert publish_all(conn, "outbox_new") == 3
        assert conn.execute("DELETE FROM outbox_published").rowcount == 3


def test_a_migration_started_by_an_earlier_release_keeps_its_steps(dsn: str) -> None:
    """A migration whose ledger row records no publications (started before issue 18) does
    not grow a V2 step it never had: V3 runs as it would have (before: refused with "V3
    before V2")."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        with Runner(dsn, SETTINGS, "hop") as runner:
            runner.run("V2")
        # what an earlier release recorded; the flat outbox is in a publication meanwhile
        conn.execute("UPDATE outbox_migrate.migration SET spec = spec - 'publications'")
        conn.execute("CREATE PUBLICATION dbz FOR TABLE outbox")
        publish_all(conn, "outbox")
        with Runner(dsn, SETTINGS, "hop") as runner:
            runner.run("V3")
            ids = [s["id"] for s in runner.status()["steps"]]
        assert "hop.v2.publish-unpublished-partition" not in ids
        assert "hop.v3.gate-old-table-retired" in ids
        assert members(conn, "dbz") == [("outbox", None)]


def test_offline_sql_without_a_dsn_stops_before_v2_is_deployed(dsn: str, pg_server: Server) -> None:
    """`plan --format sql` without `--dsn` (and Alembic `--sql`) cannot know of a publication:
    the end of V2 asserts that none lists the old outbox without the unpublished partition,
    so the DBA learns it before deploying V2 (before: the SQL applied silently and the
    consumer missed every V2 message)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        conn.execute("CREATE PUBLICATION dbz FOR TABLE outbox")
    offline = run_cli("plan", "--pattern", "hoper", "--format", "sql")
    assert offline.returncode == 0, offline.stderr
    v2 = split_sql_phases(offline.stdout)["V2"]
    applied = psql(pg_server, dsn, v2)
    assert applied.returncode != 0
    assert "publication dbz lists" in applied.stderr and "publish-unpublished-partition" in (
        applied.stderr
    )
    assert "ALTER TABLE" in applied.stderr and "REPLICA IDENTITY FULL" in applied.stderr
    guard = v2[v2.index("-- check: no publication lists") :]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER PUBLICATION dbz ADD TABLE outbox_unpublished")
    # Listed but without a replica identity, every mark of the V2 relay would fail: the guard
    # said "or ALTER PUBLICATION … ADD TABLE" alone, and let V2 be deployed that way.
    half_fixed = psql(pg_server, dsn, guard)
    assert half_fixed.returncode != 0 and "no REPLICA IDENTITY FULL" in half_fixed.stderr
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox_unpublished REPLICA IDENTITY FULL")
    assert psql(pg_server, dsn, guard).returncode == 0
    with psycopg.connect(dsn, autocommit=True) as conn:  # what the V2 relay's mark does
        conn.execute("INSERT INTO outbox_new (payload) VALUES ('{}')")
        conn.execute("UPDATE outbox_new SET published_at = now() WHERE published_at IS NULL")
