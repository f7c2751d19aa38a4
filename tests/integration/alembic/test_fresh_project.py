"""A pattern shipped through a fresh `alembic init` project, online and offline.

Generate → upgrade phase by phase (the application simulated between phases) → downgrade
where allowed, refused where not; the offline SQL of every revision applied with psql gives
the schema online mode gives; a violated precondition in offline SQL aborts with its message
and leaves no revision half-applied.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from alembic import command
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from outbox_migrate_harness.testing.server import Server

from outbox_migrate.alembic_ext import AlembicStepError
from outbox_migrate.alembic_ext.generate import generate
from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.errors import LockBudgetExceeded, OutOfOrder, PreconditionFailed
from outbox_migrate.patterns import BuildOptions, build_pattern
from outbox_migrate.patterns.model import Pattern
from outbox_migrate.runner import Runner
from tests.integration.alembic.conftest import APP_REVISION
from tests.support.alembic_project import (
    chain,
    config_for,
    offline_sql,
    psql,
    schema_dump,
    version_of,
)
from tests.support.app import act_as, count, exercise, publish_all

SETTINGS = load_settings({}, environ={})


def hoper() -> Pattern:
    return build_pattern("hoper", OutboxSpec(), BuildOptions(sample_window_s=0.1))


def seed(conn: psycopg.Connection) -> int:
    create_flat_outbox(conn)
    insert_rows(conn, "outbox", 200, published=True)
    insert_rows(conn, "outbox", 10)
    return 210


def before_phase(conn: psycopg.Connection, pattern: Pattern, index: int) -> None:
    """The previous version finished its rollout: it drained what it publishes from."""
    previous = pattern.phases[index - 1]
    if previous.app.publishes_from.value in ("old", "old-then-new"):
        publish_all(conn, "outbox")


def partitions(conn: psycopg.Connection) -> dict[str, str]:
    return dict(
        conn.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'outbox_new'::regclass"
        ).fetchall()
    )


def test_generate_chains_after_the_head(project: Path) -> None:
    result = generate("hoper", SETTINGS, project.parent, tag="t1")
    ids = [r["revision"] for r in result.revisions]
    assert result.down_revision == APP_REVISION
    assert chain(project) == [APP_REVISION, *ids]
    assert [r["steps"][0] for r in result.revisions] == [s.id for s in hoper().steps()]
    assert result.phase_targets == {
        "V2": "t1_hoper_v2_10", "V3": "t1_hoper_v3_01", "V4": "t1_hoper_v4_07",
        "copy-back": "t1_hoper_copy_back_02",
    }  # fmt: skip
    assert result.hints  # the stock env.py lacks transaction_per_migration


def test_upgrade_phase_by_phase_and_downgrade(project: Path, dsn: str) -> None:
    targets = generate("hoper", SETTINGS, project.parent, tag="t1").phase_targets
    config = config_for(project, dsn)
    pattern = hoper()
    with psycopg.connect(dsn, autocommit=True) as conn:
        written = seed(conn)
        command.upgrade(config, APP_REVISION)
        for index, phase in enumerate(pattern.phases[1:], start=1):
            before_phase(conn, pattern, index)
            command.upgrade(config, targets[phase.name])
            assert version_of(conn) == targets[phase.name]
            exercise(dsn, phase)
            act_as(conn, phase)
            written += 7
            if phase.name == "V2":
                # V2 wrote into outbox_new: dropping the partitions is refused, and the
                # revisions undone before the refusal are recorded as undone.
                with pytest.raises(AlembicStepError, match="holds rows") as refused:
                    command.downgrade(config, APP_REVISION)
                assert isinstance(refused.value.error, PreconditionFailed)
                assert version_of(conn) == "t1_hoper_v2_08"
                command.upgrade(config, targets["V2"])
            if phase.name == "V4":
                # The way back after the cutover, the V3 application still working, and
                # forward again.
                command.downgrade(config, targets["V3"])
                assert version_of(conn) == targets["V3"]
                bounds = partitions(conn)
                assert bounds["outbox_published"] == "DEFAULT" and "outbox" not in bounds
                exercise(dsn, pattern.phase("V3"))
                command.upgrade(config, targets["V4"])
                assert partitions(conn)["outbox"] == "DEFAULT"
        with Runner(dsn, SETTINGS, "hoper") as runner:
            assert runner.verify() == []
            status = runner.status()
        assert status["state"] == "completed"
        assert count(conn, "outbox_new") == written
        with pytest.raises(
            AlembicStepError, match=r"cannot roll back hoper\.copy-back\.drop-published"
        ) as refused:
            command.downgrade(config, "-1")
        assert isinstance(refused.value.error, OutOfOrder)
        assert version_of(conn) == targets["copy-back"]


def test_offline_sql_of_each_revision_gives_the_online_schema(
    project_per_migration: Path, pg_server: Server, dsn: str, other_dsn: str
) -> None:
    result = generate("hoper", SETTINGS, project_per_migration.parent, tag="t2")
    ends = {target: phase for phase, target in result.phase_targets.items()}
    pattern = hoper()
    names = pattern.phase_names()
    # Online.
    config = config_for(project_per_migration, dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        seed(conn)
        command.upgrade(config, APP_REVISION)
        for index, phase in enumerate(pattern.phases[1:], start=1):
            before_phase(conn, pattern, index)
            command.upgrade(config, result.phase_targets[phase.name])
            act_as(conn, phase)
        online_rows = count(conn, "outbox_new")
    # Offline: every revision's SQL on its own, through psql.
    with psycopg.connect(other_dsn, autocommit=True) as conn:
        seed(conn)
        applied = psql(pg_server, other_dsn, offline_sql(project_per_migration, other_dsn, None,
                                                         APP_REVISION))  # fmt: skip
        assert applied.returncode == 0, applied.stderr
        previous = APP_REVISION
        phase_started = True
        for revision in [r["revision"] for r in result.revisions]:
            phase = next(r["phase"] for r in result.revisions if r["revision"] == revision)
            if phase_started:
                before_phase(conn, pattern, names.index(phase))
            text = offline_sql(project_per_migration, other_dsn, previous, revision)
            assert "DO $om_assert$" in text or "gate" not in revision
            applied = psql(pg_server, other_dsn, text)
            assert applied.returncode == 0, f"{revision}: {applied.stderr}"
            assert version_of(conn) == revision
            phase_started = revision in ends
            if phase_started:
                act_as(conn, pattern.phase(ends[revision]))
            previous = revision
        assert count(conn, "outbox_new") == online_rows
    assert schema_dump(pg_server, other_dsn) == schema_dump(pg_server, dsn)


def test_offline_precondition_aborts_and_leaves_nothing_half_applied(
    project_per_migration: Path, pg_server: Server, dsn: str
) -> None:
    ini = project_per_migration
    targets = generate("hoper", SETTINGS, ini.parent, tag="t3").phase_targets
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5)
        assert psql(pg_server, dsn, offline_sql(ini, dsn, None, targets["V2"])).returncode == 0
        # V3 and V4 while V1 left 5 unpublished rows: the gate's assertion stops everything.
        failed = psql(pg_server, dsn, offline_sql(ini, dsn, targets["V2"], targets["V4"]))
        assert failed.returncode != 0
        assert "precondition of hoper.v3.gate-old-table-retired" in failed.stderr
        assert "5 unpublished rows remain in" in failed.stderr
        assert version_of(conn) == targets["V2"]
        publish_all(conn, "outbox")
        assert (
            psql(pg_server, dsn, offline_sql(ini, dsn, targets["V2"], targets["V3"])).returncode
            == 0
        )
        # Unpublished rows appear again after the gate: V4's first revision (drop identity)
        # commits with its version; the second one's assertion aborts it entirely.
        insert_rows(conn, "outbox", 3)
        failed = psql(pg_server, dsn, offline_sql(ini, dsn, targets["V3"], targets["V4"]))
        assert failed.returncode != 0
        assert (
            "precondition of hoper.v4.add-not-valid-check [old-table-drained:outbox]"
            in failed.stderr
        )
        assert "3 unpublished rows remain in" in failed.stderr
        assert version_of(conn) == "t3_hoper_v4_01"
        identity = conn.execute(
            "SELECT attidentity FROM pg_attribute WHERE attrelid = 'outbox'::regclass "
            "AND attname = 'id'"
        ).fetchone()
        assert identity == ("",)
        assert conn.execute(
            "SELECT count(*) FROM pg_constraint WHERE conname = 'outbox_published_check'"
        ).fetchone() == (0,)


PROBE = '''"""probe: the session settings a later, ordinary revision runs with

Revision ID: probe01
Revises: {down}
"""
from alembic import op

revision = "probe01"
down_revision = "{down}"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE TABLE probe AS SELECT current_setting('lock_timeout') AS lock_timeout, "
        "current_setting('statement_timeout') AS statement_timeout"
    )


def downgrade() -> None:
    op.execute("DROP TABLE probe")
'''


@pytest.mark.parametrize("layout", ["project", "project_per_migration"])
def test_step_timeouts_never_reach_the_next_revision(
    layout: str, request: pytest.FixtureRequest, dsn: str
) -> None:
    ini: Path = request.getfixturevalue(layout)
    targets = generate("hop", SETTINGS, ini.parent, tag="s1").phase_targets
    versions = ini.parent / "migrations" / "versions"
    (versions / "probe01_probe.py").write_text(PROBE.format(down=targets["V2"]))
    config = config_for(ini, dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        command.upgrade(config, "probe01")  # V2's five steps, then the probe, one session
        assert conn.execute("SELECT lock_timeout, statement_timeout FROM probe").fetchone() == (
            "0",
            "0",
        )
        assert version_of(conn) == "probe01"


def test_phase_revisions_online(project_per_migration: Path, dsn: str) -> None:
    """`--split phase`: op.outbox_phase forward, op.outbox_reverse_phase back, forward again."""
    from outbox_migrate.alembic_ext.revisions import Split

    ini = project_per_migration
    result = generate("hop", SETTINGS, ini.parent, tag="f1", split=Split.PHASE)
    assert [r["revision"] for r in result.revisions] == ["f1_hop_v2", "f1_hop_v3"]
    assert "op.outbox_phase(" in Path(result.revisions[0]["path"]).read_text()
    config = config_for(ini, dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        command.upgrade(config, "f1_hop_v2")
        assert sorted(partitions(conn)) == ["outbox_published", "outbox_unpublished"]
        command.downgrade(config, APP_REVISION)
        assert conn.execute("SELECT to_regclass('outbox_new')").fetchone() == (None,)
        command.upgrade(config, "f1_hop_v2")
        assert version_of(conn) == "f1_hop_v2"
        with Runner(dsn, SETTINGS, "hop") as runner:
            assert runner.current_phase() == "V2"


def test_offline_then_online_adopts_what_psql_applied(
    project_per_migration: Path, pg_server: Server, dsn: str
) -> None:
    """V2 to V4 applied by a DBA from `--sql`, copy-back online: the runner adopts the earlier
    steps (postconditions hold, or a later step undid them on purpose, like the CHECK the
    swap no longer needs) instead of running them again; the ledger ends completed."""
    ini = project_per_migration
    targets = generate("hoper", SETTINGS, ini.parent, tag="m1").phase_targets
    pattern = hoper()
    with psycopg.connect(dsn, autocommit=True) as conn:
        seed(conn)
        previous = None
        for index, phase in enumerate(pattern.phases[1:4], start=1):
            before_phase(conn, pattern, index)
            text = offline_sql(ini, dsn, previous, targets[phase.name])
            assert psql(pg_server, dsn, text).returncode == 0, phase.name
            act_as(conn, phase)
            previous = targets[phase.name]
        command.upgrade(config_for(ini, dsn), targets["copy-back"])
        assert version_of(conn) == targets["copy-back"]
    with Runner(dsn, SETTINGS, "hoper") as runner:
        status = runner.status()
        assert runner.verify() == []
    assert status["state"] == "completed"
    assert [s["state"] for s in status["steps"]] == ["done"] * len(pattern.steps())


def test_a_step_refuses_to_run_before_the_one_it_needs(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    with Runner(dsn, SETTINGS, "hop") as runner:
        with pytest.raises(OutOfOrder, match=r"needs hop\.v2\.create-partitioned-table first"):
            runner.execute_step("hop.v2.create-unpublished-partition")
        assert runner.execute_step("hop.v2.create-partitioned-table").ran == [
            "hop.v2.create-partitioned-table"
        ]
        assert runner.execute_step("hop.v2.create-partitioned-table").skipped == [
            "hop.v2.create-partitioned-table"
        ]
        assert runner.reverse_step("hop.v2.create-unpublished-index") is False  # never applied
        assert runner.reverse_step("hop.v2.create-partitioned-table") is True


@pytest.mark.parametrize("layout", ["project", "project_per_migration"])
def test_lock_budget_online_names_the_blocker_and_applies_nothing(
    layout: str, request: pytest.FixtureRequest, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session holding ACCESS EXCLUSIVE on the outbox: the step retries under
    lock_timeout until its budget is spent, fails naming the blocker, and neither the step
    nor alembic_version moved; once the blocker is gone the same upgrade succeeds."""
    ini: Path = request.getfixturevalue(layout)
    monkeypatch.setenv("OUTBOX_MIGRATE_LOCK_BUDGET_S", "1")
    monkeypatch.setenv("OUTBOX_MIGRATE_LOCK_TIMEOUT_MS", "50")
    targets = generate("hop", SETTINGS, ini.parent, tag="l1").phase_targets
    config = config_for(ini, dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        command.upgrade(config, APP_REVISION)
        with psycopg.connect(dsn, autocommit=True) as blocker:
            blocker.execute("SET application_name = 'long-report'")
            with blocker.transaction():
                blocker.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(AlembicStepError, match="could not take its locks") as failed:
                    command.upgrade(config, targets["V2"])
        assert isinstance(failed.value.error, LockBudgetExceeded)
        assert "long-report" in str(failed.value)
        assert version_of(conn) == APP_REVISION
        assert conn.execute("SELECT to_regclass('outbox_new')").fetchone() == (None,)
        command.upgrade(config, targets["V2"])
        assert version_of(conn) == targets["V2"]


def test_revisions_generated_without_a_dsn_carry_a_publication_online(
    project: Path, dsn: str
) -> None:
    """CDC users (issue 18): the per-step revisions know nothing of the publication; online,
    the runner slots the conditional step in before V2's next step, and unwinds it on the
    way down (before this, V2's upgrade stopped: "needs …publish-unpublished-partition")."""
    targets = generate("hoper", SETTINGS, project.parent, tag="t1").phase_targets
    config = config_for(project, dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        seed(conn)
        conn.execute("CREATE PUBLICATION dbz FOR TABLE outbox")
        command.upgrade(config, targets["V2"])
        listed = "SELECT count(*) FROM pg_publication_tables WHERE pubname = 'dbz'"
        assert conn.execute(listed).fetchone() == (2,)
        command.downgrade(config, APP_REVISION)
        assert conn.execute(listed).fetchone() == (1,)
        assert conn.execute("SELECT to_regclass('outbox_new')").fetchone() == (None,)
