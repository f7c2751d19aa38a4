"""Safety at commit (issue 13): each scenario here lost a message, dropped a live object or
lied about progress on the 0.1 runner, whose preconditions were checked once, before the
step waited for its lock.

Every test races a real session against the runner on a real server: the writer holds its
transaction open while the runner waits, commits, and the runner must then see its row.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.config import load_settings
from outbox_migrate.errors import OutOfOrder, PreconditionFailed, SchemaError, UsageError
from outbox_migrate.runner import Runner
from tests.support.app import act_as, publish_all
from tests.support.cli import run_cli

SETTINGS = load_settings({"gate_window_s": 0.2, "lock_budget_s": 20.0}, environ={})
HOLD_S = 1.0
"""How long the racing writer keeps its transaction open while the runner waits."""


def forward(dsn: str, pattern: str, until: str) -> None:
    """Drive `pattern` to the end of phase `until` the way the playbook says: each phase's
    steps, then that phase's application (one insert and, where it publishes, a drain)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        with Runner(dsn, SETTINGS, pattern) as runner:
            phases = runner.pattern.phases
        for index, phase in enumerate(phases[1:], start=1):
            if phases[index - 1].app.publishes_from.value in ("old", "old-then-new"):
                publish_all(conn, "outbox")
            with Runner(dsn, SETTINGS, pattern) as runner:
                runner.run(phase.name)
            act_as(conn, phase)
            if phase.name == until:
                return


class HeldWriter:
    """A session that inserts one row and keeps its transaction open for `hold_s` (the
    row's lock is held, the row is invisible to everyone else), then commits."""

    def __init__(self, dsn: str, statement: str, hold_s: float = HOLD_S) -> None:
        self.conn = psycopg.connect(dsn, application_name="held-writer")
        self.conn.execute(statement)
        self.hold_s = hold_s
        self.committed = threading.Event()
        self.thread = threading.Thread(target=self._commit_later, daemon=True)

    def _commit_later(self) -> None:
        time.sleep(self.hold_s)
        self.conn.commit()
        self.committed.set()

    def __enter__(self) -> HeldWriter:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.thread.join(10)
        self.conn.close()


def test_in_flight_writer_keeps_its_message_through_rollback(dsn: str) -> None:
    """HOP at V2, a V2 writer's INSERT into the partitioned table is in flight while the
    inverse of create-unpublished-partition drops it: the emptiness check must see the row
    once the writer commits (0.1 checked before the lock; the DROP waited, then destroyed
    the committed row)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5, published=True)
        with Runner(dsn, SETTINGS, "hop") as runner:
            runner.run("V2")
            # Back down to the unpublished partition, the way rollback --to V1 goes.
            v2 = [step.id for step in runner.pattern.phase("V2").steps]
            below = v2.index("hop.v2.create-unpublished-partition")
            for step_id in reversed(v2[below + 1 :]):
                assert runner.reverse_step(step_id)
        insert = 'INSERT INTO outbox_new (payload) VALUES (\'{"in": "flight"}\')'
        with HeldWriter(dsn, insert) as writer, Runner(dsn, SETTINGS, "hop") as runner:
            with pytest.raises(PreconditionFailed, match="holds rows"):
                runner.reverse_step("hop.v2.create-unpublished-partition")
            assert writer.committed.is_set()
        assert conn.execute(
            "SELECT count(*) FROM outbox_unpublished WHERE payload->>'in' = 'flight'"
        ).fetchone() == (1,)


def test_old_writer_holding_the_lock_makes_drop_identity_refuse(dsn: str) -> None:
    """HOPER at V3: a V1 writer inserted before the gate's window and commits while
    DROP IDENTITY waits for the lock. Its transaction is still open during the sample (the
    gate trigger's advisory lock shows it) or its row committed since (under the lock): a
    writer of the old version is alive either way: refuse, do not apply."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5, published=True)
        forward(dsn, "hoper", "V3")
        insert = "INSERT INTO outbox (payload, published_at) VALUES ('{}', now())"
        refused = pytest.raises(PreconditionFailed, match="needs every writer of the old version")
        with (
            HeldWriter(dsn, insert, hold_s=HOLD_S + 0.5) as writer,
            Runner(dsn, SETTINGS, "hoper") as runner,
            refused,
        ):
            runner.run("V4")
        assert writer.committed.is_set()
        identity = conn.execute(
            "SELECT attidentity FROM pg_attribute WHERE attrelid = 'outbox'::regclass "
            "AND attname = 'id'"
        ).fetchone()
        assert identity == ("a",)  # the identity is still there: nothing applied
        state = conn.execute(
            "SELECT state, last_error FROM outbox_migrate.step "
            "WHERE step_id = 'hoper.v4.drop-identity'"
        ).fetchone()
        assert state is not None and state[0] == "pending"
        assert "needs every writer of the old version gone" in state[1]


@pytest.mark.parametrize(
    ("layout", "statements"),
    [
        (
            "bigserial id",
            [
                "CREATE TABLE outbox (id bigserial PRIMARY KEY, payload jsonb NOT NULL, "
                "created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz)"
            ],
        ),
        (
            "no publication column",
            [
                "CREATE TABLE outbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                "payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
            ],
        ),
        (
            "foreign key into the outbox",
            [
                "CREATE TABLE outbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                "payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), "
                "published_at timestamptz)",
                "CREATE TABLE receipt (outbox_id bigint REFERENCES outbox (id))",
            ],
        ),
    ],
)
def test_run_refuses_what_plan_reports_before_touching_the_ledger(
    dsn: str, layout: str, statements: list[str]
) -> None:
    """Whatever `plan` reports as a blocker, `run` refuses with the same line and exit 2,
    and the database is left as it was: no ledger schema, no migration record, no table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)
    plan = run_cli("plan", "--pattern", "hoper", "--dsn", dsn, "--format", "json")
    run = run_cli("run", "--pattern", "hoper", "--to", "V2", "--dsn", dsn)
    if plan.returncode == 0:  # a layout another issue made supported: then both accept it
        assert run.returncode == 0, run.stderr
        return
    assert plan.returncode == 2, plan.stderr
    assert run.returncode == 2, run.stderr
    plan_line = plan.stderr.strip().splitlines()[-1]
    assert run.stderr.strip().splitlines()[-1] == plan_line, layout
    assert "Traceback" not in run.stderr
    with psycopg.connect(dsn, autocommit=True) as conn:
        untouched = conn.execute(
            "SELECT to_regnamespace('outbox_migrate'), to_regclass('outbox_new')"
        ).fetchone()
        assert untouched == (None, None)


def test_refused_out_of_order_run_registers_no_migration(dsn: str) -> None:
    """`run --to V3` on a fresh table is refused (exit 2) and leaves no active migration that
    would block every other pattern until `reset`."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        with Runner(dsn, SETTINGS, "hoper") as runner, pytest.raises(OutOfOrder):
            runner.run("V3")
        assert conn.execute("SELECT to_regnamespace('outbox_migrate')").fetchone() == (None,)
        with Runner(dsn, SETTINGS, "hop") as runner:
            assert runner.run("V2").phase == "V2"  # another pattern is free to start


def test_second_pattern_on_a_migrated_table_is_refused_and_drops_nothing(dsn: str) -> None:
    """After HOPER completed, HOP must not adopt HOPER's live objects; its rollback must not
    drop the unpublished partition the relay is publishing from."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5, published=True)
        forward(dsn, "hoper", "copy-back")
        with Runner(dsn, SETTINGS, "hoper") as runner:
            assert runner.status()["state"] == "completed"
        conn.execute("INSERT INTO outbox_new (payload) VALUES ('{}')")
        with Runner(dsn, SETTINGS, "hop") as runner, pytest.raises(UsageError, match="HOPER"):
            runner.run("V2")
        with Runner(dsn, SETTINGS, "hop") as runner, pytest.raises(OutOfOrder):
            runner.rollback("V1")
        assert conn.execute("SELECT count(*) FROM outbox_unpublished").fetchone() == (1,)
        rows = conn.execute("SELECT pattern FROM outbox_migrate.migration ORDER BY id").fetchall()
        assert rows == [("hoper",)]


def test_rollback_to_a_phase_ahead_is_refused(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        forward(dsn, "hoper", "V3")
    result = run_cli("rollback", "--pattern", "hoper", "--to", "V4", "--dsn", dsn)
    assert result.returncode == 2, result.stderr
    assert "ahead of the current phase V3" in result.stderr


def test_objects_not_created_by_the_migration_are_never_dropped(dsn: str) -> None:
    """A partitioned table made by hand (or by offline SQL) is adopted by `run`, but a
    rollback refuses to drop it: only what the migration created is its to drop."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        conn.execute(
            "CREATE TABLE outbox_new (LIKE outbox INCLUDING DEFAULTS INCLUDING IDENTITY) "
            "PARTITION BY LIST (published_at)"
        )
        conn.execute("SELECT setval(pg_get_serial_sequence('outbox_new', 'id'), 10000000)")
        with Runner(dsn, SETTINGS, "hop") as runner:
            result = runner.run("V2")
        assert "hop.v2.create-partitioned-table" in result.adopted
        refused = pytest.raises(PreconditionFailed, match="outbox_new is not dropped")
        with Runner(dsn, SETTINGS, "hop") as runner, refused:
            runner.rollback("V1")
        assert conn.execute("SELECT to_regclass('outbox_new')").fetchone() == ("outbox_new",)
        # What the migration did create was rolled back before it stopped.
        assert conn.execute("SELECT to_regclass('outbox_unpublished')").fetchone() == (None,)


def test_wrong_table_is_refused_before_the_ledger(dsn: str) -> None:
    with Runner(dsn, SETTINGS, "hop") as runner, pytest.raises(SchemaError):
        runner.run("V2")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regnamespace('outbox_migrate')").fetchone() == (None,)


def test_copy_back_started_by_the_job_is_finished_by_run(dsn: str) -> None:
    """The standalone job copies, verifies and drops the detached partition; `run --to
    copy-back` then finds the work done and records it (0.1: `relation … does not exist`
    for ever, the ledger stuck at V4)."""
    from outbox_migrate.jobs.copy_back import copy_back

    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5, published=True)
        forward(dsn, "hoper", "V4")
        copy_back(conn, SETTINGS.spec, drop=True)
        assert conn.execute("SELECT to_regclass('outbox_published')").fetchone() == (None,)
    result = run_cli("run", "--pattern", "hoper", "--to", "copy-back", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    status = run_cli("status", "--pattern", "hoper", "--dsn", dsn, "--format", "json")
    assert status.returncode == 0, status.stderr
    assert '"completed"' in status.stdout


def test_copy_back_started_by_run_is_finished_by_the_command(dsn: str) -> None:
    """`run` copies (the copy-back step alone, as after an interrupted run), then
    `outbox-migrate copy-back` finishes: same ledger rows, migration complete."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5, published=True)
        forward(dsn, "hoper", "V4")
        with Runner(dsn, SETTINGS, "hoper") as runner:
            runner.execute_step("hoper.copy-back.copy-back")
    result = run_cli("copy-back", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT step_id, state FROM outbox_migrate.step WHERE phase = 'copy-back' "
            "ORDER BY position"
        ).fetchall()
        assert rows == [
            ("hoper.copy-back.copy-back", "done"),
            ("hoper.copy-back.drop-published", "done"),
        ]
        migration = conn.execute("SELECT state FROM outbox_migrate.migration").fetchone()
        assert migration == ("completed",)
        assert conn.execute("SELECT to_regclass('outbox_published')").fetchone() == (None,)


def test_an_autocommit_step_whose_locked_precondition_broke_by_its_end_is_not_done(
    dsn: str,
) -> None:
    """A step run outside a transaction block commits statement by statement, so nothing
    holds its preconditions while it runs: they are proved again once it ended, and a step
    whose LOCKED precondition no longer holds is not recorded done (here its own statement
    breaks it; in the field a concurrent session would)."""
    from dataclasses import replace

    from psycopg import sql

    from outbox_migrate.errors import StepFailed
    from outbox_migrate.patterns.model import CheckPoint, Condition, TxMode
    from outbox_migrate.runner import ledger

    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5, published=True)
        forward(dsn, "hoper", "V3")
        conn.execute("CREATE TABLE canary (id int)")
        canary = Condition(
            "canary-exists", "the canary table is there",
            sql.SQL("SELECT 'canary is gone' WHERE to_regclass('canary') IS NULL"),
            at=CheckPoint.LOCKED,
        )  # fmt: skip
        with Runner(dsn, SETTINGS, "hoper") as runner:
            real = next(s for p in runner.pattern.phases for s in p.steps if s.phase == "V4")
            step = replace(real, tx=TxMode.AUTOCOMMIT, statements=(sql.SQL("DROP TABLE canary"),),
                           preconditions=(canary,), postcondition=())  # fmt: skip
            migration = ledger.active_for_table(runner.conn, SETTINGS.spec)
            assert migration is not None
            applier = runner._applier(migration.id)
            with pytest.raises(StepFailed, match="canary is gone"):
                applier.apply_autocommit(step)
        state = conn.execute(
            "SELECT state FROM outbox_migrate.step WHERE step_id = %s", (real.id,)
        ).fetchone()
        assert state is not None and state[0] != "done"
