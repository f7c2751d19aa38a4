"""Rollback: every reversible step's inverse, and the way back after the cutover.

Forward through the pattern with the application writing, back to the phase before the
cutover (re-attach the published partition / detach the old table), the application of that
phase still working and no row lost, then forward again to a verified end.
"""

from __future__ import annotations

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.config import load_settings
from outbox_migrate.errors import OutOfOrder
from outbox_migrate.runner import Runner
from tests.support.app import act_as, exercise, publish_all

SETTINGS = load_settings({"gate_window_s": 0.05, "lock_budget_s": 10.0}, environ={})


def total_rows(conn: psycopg.Connection) -> int:
    """Distinct message ids across the old and the new outbox and a detached published table
    (HOPIA's trigger keeps copies in the old table, so rows are counted once by id)."""
    sources = ["SELECT id FROM outbox_new", "SELECT id FROM outbox"]
    if conn.execute("SELECT to_regclass('outbox_published')").fetchone() != (None,):
        sources.append("SELECT id FROM outbox_published")
    row = conn.execute(
        "SELECT count(DISTINCT id) FROM (" + " UNION ALL ".join(sources) + ") ids"
    ).fetchone()
    assert row is not None
    return int(row[0])


def forward(dsn: str, name: str, until: str) -> int:
    written = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        with Runner(dsn, SETTINGS, name) as runner:
            pattern = runner.pattern
            start = pattern.phase_names().index(runner.current_phase()) + 1
        for index in range(start, pattern.phase_names().index(until) + 1):
            phase = pattern.phases[index]
            previous = pattern.phases[index - 1]
            if previous.app.publishes_from.value in ("old", "old-then-new"):
                publish_all(conn, "outbox")
            with Runner(dsn, SETTINGS, name) as runner:
                runner.run(phase.name)
            act_as(conn, phase)
            written += 7
    return written


@pytest.mark.parametrize(
    ("name", "cutover_done", "back_to"),
    [("copra", "V3", "V2"), ("hoper", "V4", "V3"), ("hopia", "V4", "V3")],
)
def test_way_back_after_cutover(name: str, cutover_done: str, back_to: str, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 200, published=True)
    written = 200 + forward(dsn, name, cutover_done)
    with Runner(dsn, SETTINGS, name) as runner:
        pattern = runner.pattern
        undone = runner.rollback(back_to)
        assert runner.current_phase() == back_to
        assert runner.verify() == []
    assert undone == [s.id for s in reversed(pattern.phase(cutover_done).steps)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        partitions = dict(
            conn.execute(
                "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
                "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'outbox_new'::regclass"
            ).fetchall()
        )
        assert "outbox" not in partitions
        if name != "copra":
            assert partitions["outbox_published"] == "DEFAULT"
        identity = conn.execute(
            "SELECT attidentity FROM pg_attribute WHERE attrelid = 'outbox'::regclass "
            "AND attname = 'id'"
        ).fetchone()
        assert identity == ("a",)
        assert conn.execute(
            "SELECT count(*) FROM pg_constraint WHERE conrelid = 'outbox'::regclass AND contype = 'c'"
        ).fetchone() == (0,)
        assert total_rows(conn) == written
    exercise(dsn, pattern.phase(back_to))
    # … and forward again to the end.
    forward(dsn, name, pattern.phases[-1].name if name != "hoper" else "V4")
    with Runner(dsn, SETTINGS, name) as runner:
        assert runner.verify() == []


def test_rollback_to_v1_restores_the_original_schema(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        before = conn.execute(
            "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace ORDER BY 1"
        ).fetchall()
    with Runner(dsn, SETTINGS, "hopia") as runner:
        runner.run("V2")
        undone = runner.rollback("V1")
    assert len(undone) == 11
    with psycopg.connect(dsn, autocommit=True) as conn:
        after = conn.execute(
            "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace ORDER BY 1"
        ).fetchall()
        assert after == before
        assert conn.execute(
            "SELECT count(*) FROM pg_proc WHERE proname LIKE 'outbox%'"
        ).fetchone() == (0,)


def test_dropping_a_table_with_rows_is_refused(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        with Runner(dsn, SETTINGS, "hop") as runner:
            runner.run("V2")
        insert_rows(conn, "outbox_new", 3)
    from outbox_migrate.errors import PreconditionFailed

    with (
        Runner(dsn, SETTINGS, "hop") as runner,
        pytest.raises(PreconditionFailed, match="holds rows"),
    ):
        runner.rollback("V1")


def test_no_way_back_past_the_point_of_no_return(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 50, published=True)
    forward(dsn, "hoper", "copy-back")
    with (
        Runner(dsn, SETTINGS, "hoper") as runner,
        pytest.raises(OutOfOrder, match=r"cannot roll back past hoper\.copy-back\.drop-published"),
    ):
        runner.rollback("V3")


def test_a_rollback_that_undoes_nothing_leaves_a_completed_migration_completed(dsn: str) -> None:
    """`rollback --to V4` of a completed COPRA migration rolled back 0 steps and set it
    back to `active`, as if it had a way still to go."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5)
    forward(dsn, "copra", "V4")
    state = "SELECT state, current_phase FROM outbox_migrate.migration"
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = conn.execute(state).fetchall()
        assert before == [("completed", "V4")]
        with Runner(dsn, SETTINGS, "copra") as runner:
            assert runner.rollback("V4") == []
        assert conn.execute(state).fetchall() == before
