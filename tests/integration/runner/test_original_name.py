"""The optional original-name phases on a real server: every pattern to the end with them, the
previous version inserting through the view (identity and defaults of the base table), grants
on the view, `status`/`verify` (with and without --with-optional) after the rename, rollback of
the rename and of the view's drop, and forward again."""

from __future__ import annotations

import os
import uuid
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.errors import PreconditionFailed
from outbox_migrate.patterns import PATTERN_NAMES, notify
from outbox_migrate.runner import Runner
from outbox_migrate.runner import inspect as read_only
from outbox_migrate.runner.apply import FAULT_ENV
from tests.integration.runner.test_crash_recovery import terminate_runner_backends
from tests.support.app import act_as, count, publish_all

FAST = {"gate_window_s": 0.2, "lock_budget_s": 10.0}


def settings(**extra: Any) -> Any:
    return load_settings({**FAST, **extra}, environ={})


def relkinds(conn: psycopg.Connection) -> dict[str, str | None]:
    """What each name is now: r table, p partitioned, v view, None absent; `+` = partition."""
    found: dict[str, str | None] = {}
    for name in ("outbox", "outbox_new", "outbox_published", "outbox_retired"):
        row = conn.execute(
            "SELECT c.relkind::text || CASE WHEN c.relispartition THEN '+' ELSE '' END "
            "FROM pg_class c WHERE c.oid = to_regclass(%s)",
            (name,),
        ).fetchone()
        found[name] = row[0] if row else None
    return found


def run_through_base(conn: psycopg.Connection, dsn: str, name: str) -> tuple[Any, int]:
    """Every phase of the pattern without the optional ones, as an operator would."""
    insert_rows(conn, "outbox", 200, published=True)
    insert_rows(conn, "outbox", 5)
    written = 205
    pattern = Runner(dsn, settings(), name, include_optional=True).pattern
    base = [p for p in pattern.phases if p.name not in ("original-name", "drop-view")]
    for index, phase in enumerate(base[1:], start=1):
        if base[index - 1].app.publishes_from.value in ("old", "old-then-new"):
            publish_all(conn, "outbox")
        with Runner(dsn, settings(), name, include_optional=True) as runner:
            assert runner.run(phase.name).phase == phase.name
        act_as(conn, phase)
        written += 7
    # Complete without the optional phases: they may follow, or never come.
    assert read_only.status(dsn, settings(), include_optional=True)["state"] == "completed"
    return pattern, written


def insert_one(conn: psycopg.Connection, table: str) -> tuple[int, Any, Any]:
    row = conn.execute(
        psycopg.sql.SQL(
            "INSERT INTO {} (event_type, payload) VALUES ('e', '{{}}') "
            "RETURNING id, created_at, published_at"
        ).format(psycopg.sql.Identifier(table))
    ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_pattern_takes_the_original_name(name: str, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        writer = f"om_app_{uuid.uuid4().hex[:8]}"  # roles are cluster-wide: one per test
        conn.execute(psycopg.sql.SQL("CREATE ROLE {}").format(psycopg.sql.Identifier(writer)))
        # The application's grant on the flat table travels to the partitioned table (the
        # creating steps), then to the view under its former name (the rename).
        conn.execute(
            psycopg.sql.SQL("GRANT SELECT, INSERT ON outbox TO {}").format(
                psycopg.sql.Identifier(writer)
            )
        )
        pattern, written = run_through_base(conn, dsn, name)
        top = conn.execute("SELECT max(id) FROM outbox_new").fetchone()[0]
        retired = name in ("cop", "hop")

        with Runner(dsn, settings(), name, include_optional=True) as runner:
            assert runner.run("original-name").ran == [f"{name}.original-name.take-original-name"]
        kinds = relkinds(conn)
        assert kinds["outbox"] == "p" and kinds["outbox_new"] == "v"
        assert kinds["outbox_published"] == "r+"
        assert kinds["outbox_retired"] == ("r" if retired else None)

        # The previous version inserts through the view: the base table's identity and
        # defaults apply, and the row lands in the unpublished partition of `outbox`.
        new_id, created_at, published_at = insert_one(conn, "outbox_new")
        assert new_id > top and created_at is not None and published_at is None
        where = conn.execute(
            "SELECT tableoid::regclass::text FROM outbox WHERE id = %s", (new_id,)
        ).fetchone()
        assert where == ("outbox_unpublished",)
        # Its role keeps the grants it had on the table, now on the view.
        with conn.transaction():
            conn.execute(
                psycopg.sql.SQL("SET LOCAL ROLE {}").format(psycopg.sql.Identifier(writer))
            )
            insert_one(conn, "outbox_new")
        # The next version inserts into and publishes from the original name.
        insert_one(conn, "outbox")
        written += 3
        publish_all(conn, "outbox")

        # status and verify find the migration and check the renamed end state, even when
        # the operator forgets --with-optional.
        cfg = settings()
        for include in (False, True):
            document = read_only.status(dsn, cfg, include_optional=include)
            assert document["recorded"] and document["phase"] == "original-name"
            assert read_only.verify(dsn, cfg, include_optional=include) == "original-name"
        with Runner(dsn, cfg, name) as runner:
            assert runner.verify() == []

        with Runner(dsn, settings(), name, include_optional=True) as runner:
            assert runner.run("drop-view").completed
        assert relkinds(conn)["outbox_new"] is None
        insert_one(conn, "outbox")
        written += 1
        assert read_only.verify(dsn, cfg) == "drop-view"
        assert read_only.status(dsn, cfg)["state"] == "completed"
        if pattern.keep_old_rows:
            assert count(conn, "outbox") == written
        else:
            assert count(conn, "outbox") + count(conn, "outbox_retired") == written


def wake_up_key(conn: psycopg.Connection) -> int | None:
    """Which name's idle lock key the wake-up trigger's function uses (by the relay's own
    computation for the former and the original name)."""
    row = conn.execute(
        "SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure('outbox_new_relay_notify()')"
    ).fetchone()
    assert row is not None
    for spec in (OutboxSpec(), OutboxSpec(table="outbox_retired", partitioned_table="outbox")):
        key = notify.idle_lock_key(notify.label(spec))
        if f"pg_try_advisory_xact_lock_shared({key}, 0)" in row[0]:
            return key
    return None


FORMER_KEY = notify.idle_lock_key(notify.label(OutboxSpec()))
ORIGINAL_KEY = notify.idle_lock_key(
    notify.label(OutboxSpec(table="outbox_retired", partitioned_table="outbox"))
)


@pytest.mark.parametrize("name", ["hoper", "cop"])
def test_rename_rolls_back_and_forward_again(name: str, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        pattern, _ = run_through_base(conn, dsn, name)
        last_base = pattern.phases[-3].name
        before = relkinds(conn)
        assert wake_up_key(conn) == FORMER_KEY
        with Runner(dsn, settings(), name, include_optional=True) as runner:
            runner.run("original-name")
        # Relays started with the original name are the ones the wake-up trigger wakes now.
        assert wake_up_key(conn) == ORIGINAL_KEY
        with Runner(dsn, settings(), name, include_optional=True) as runner:
            runner.run("drop-view")

        # Back to the last base phase, without --with-optional: the ledger knows the steps.
        with Runner(dsn, settings(), name) as runner:
            undone = runner.rollback(last_base)
        assert undone == [
            f"{name}.drop-view.drop-compat-view",
            f"{name}.drop-view.count-view-writes",
            f"{name}.original-name.take-original-name",
        ]
        assert relkinds(conn) == before
        assert wake_up_key(conn) == FORMER_KEY
        assert read_only.verify(dsn, settings()) == last_base
        insert_one(conn, "outbox_new")

        with Runner(dsn, settings(), name, include_optional=True) as runner:
            runner.run("original-name")
        with Runner(dsn, settings(), name, include_optional=True) as runner:
            assert runner.run("drop-view").completed
            assert runner.verify() == []
        assert relkinds(conn)["outbox"] == "p"


def test_rename_refused_while_the_published_name_is_taken(dsn: str) -> None:
    """HOPIA without its optional drop of the detached published partition: the name the old
    table would take is in use, so the rename is refused and writes nothing."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        run_through_base(conn, dsn, "hopia")
        conn.execute("CREATE TABLE outbox_published_twin (LIKE outbox)")
        conn.execute("ALTER TABLE outbox_published_twin RENAME TO outbox_published")
        before = relkinds(conn)
        with (
            Runner(dsn, settings(), "hopia", include_optional=True) as runner,
            pytest.raises(PreconditionFailed, match=r"outbox_published.*already exists"),
        ):
            runner.run("original-name")
        assert relkinds(conn) == before


def test_view_is_dropped_only_once_nobody_uses_it(dsn: str) -> None:
    """The drop's gate: a session of the previous version that used the view (here: its
    transaction is still open) refuses the drop, which changes nothing; once it is gone the
    view is dropped. With old_app_name set, a connected session of it refuses too."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        run_through_base(conn, dsn, "copra")
        with Runner(dsn, settings(), "copra", include_optional=True) as runner:
            runner.run("original-name")
            assert runner.next().ran == ["copra.drop-view.count-view-writes"]
        with psycopg.connect(dsn) as previous:  # not autocommit: the transaction stays open
            insert_one(previous, "outbox_new")
            with (
                Runner(dsn, settings(), "copra", include_optional=True) as runner,
                pytest.raises(PreconditionFailed, match=r"outbox_new.*still used by other"),
            ):
                runner.run("drop-view")
            previous.rollback()
        assert relkinds(conn)["outbox_new"] == "v"
        old_app = settings(old_app_name="previous-version/%")
        with (
            psycopg.connect(dsn, application_name="previous-version/1"),
            Runner(dsn, old_app, "copra", include_optional=True) as runner,
            pytest.raises(PreconditionFailed, match=r"previous-version"),
        ):
            runner.run("drop-view")
        assert relkinds(conn)["outbox_new"] == "v"
        with Runner(dsn, old_app, "copra", include_optional=True) as runner:
            assert runner.run("drop-view").completed
        assert relkinds(conn)["outbox_new"] is None


def test_status_and_verify_find_the_renamed_migration_by_either_name(dsn: str) -> None:
    """After the rename an operator may name the outbox as it now is: the former partitioned
    name (the view) as --table, or the original name as --partitioned-table (as its relays
    do). Both find the migration recorded under the flat table's name, and verify checks the
    renamed end state."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        run_through_base(conn, dsn, "copra")
        with Runner(dsn, settings(), "copra", include_optional=True) as runner:
            runner.run("original-name")
    for names in (
        {"table": "outbox_new", "partitioned_table": "outbox_new_p"},
        {"table": "outbox_retired", "partitioned_table": "outbox"},
    ):
        cfg = settings(**names)
        document = read_only.status(dsn, cfg)
        assert document["recorded"], names
        assert (document["table"], document["phase"]) == ("public.outbox", "original-name")
        assert read_only.verify(dsn, cfg) == "original-name"


def killed_rename(dsn: str, fault: str) -> None:
    """Fork a runner that SIGKILLs itself at `fault` while running the rename."""
    pid = os.fork()
    if pid == 0:
        os.environ[FAULT_ENV] = fault
        code = 0
        try:
            with Runner(dsn, settings(), "copra", include_optional=True) as runner:
                runner.run("original-name")
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), f"{fault}: the runner was not killed"
    terminate_runner_backends(dsn)


def test_rename_survives_a_crash_at_every_point(dsn: str) -> None:
    """The rename is one transaction: killed before it or after its DDL nothing is renamed,
    killed after COMMIT everything is; a normal run then finishes (or adopts) it."""
    step = "copra.original-name.take-original-name"
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        run_through_base(conn, dsn, "copra")
        before = relkinds(conn)
        for point in ("before", "after-ddl"):
            killed_rename(dsn, f"{step}@{point}")
            assert relkinds(conn) == before, point
        killed_rename(dsn, f"{step}@after-commit")
        renamed = relkinds(conn)
        assert (renamed["outbox"], renamed["outbox_new"]) == ("p", "v")
        with Runner(dsn, settings(), "copra", include_optional=True) as runner:
            result = runner.run("original-name")
            assert step not in result.ran
            assert runner.verify() == []
        assert relkinds(conn) == renamed
