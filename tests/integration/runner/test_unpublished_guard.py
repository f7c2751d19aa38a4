"""The unpublished partition's guard (patterns/kinds/guard.py), migrated by the runner as the
table's non-superuser owner and exercised as the application's role.

Without it, NServiceBus SQL persistence's documented cleanup (`DELETE … WHERE ctid IN (SELECT
ctid … WHERE "Dispatched" = true … LIMIT 10000)`) run on the migrated table deleted every
undispatched message that shared a ctid with a dispatched one: a ctid names a row only within
one partition. With it, the cleanup still deletes the dispatched rows and none of the others
(they are written back in the same statement); marks — our relay's and a framework's own
UPDATE — still move rows out of the partition, and outbox-migrate's own sessions may still
delete there (the relay dead-letters by deleting).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from psycopg import sql

from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.db import connect
from outbox_migrate.errors import OutOfOrder
from outbox_migrate.patterns.kinds import guard
from outbox_migrate.patterns.names import Names
from outbox_migrate.relay.options import Mode, RelayOptions
from outbox_migrate.relay.sinks.stdout import StdoutSink
from outbox_migrate.relay.worker import Relay
from outbox_migrate.runner import Runner
from tests.e2e.test_zoo_frameworks import NSERVICEBUS
from tests.e2e.test_zoo_frameworks_load import NSB_SET_AS_DISPATCHED, NSB_STORE
from tests.integration.relay.conftest import swapped_outbox
from tests.integration.relay.test_least_privilege import settings as runner_settings
from tests.support.roles import DocumentedRoles

NSB_CTID_CLEANUP = (
    # SqlDialect_PostgreSql.GetOutboxCleanupCommand as NServiceBus SQL persistence documented
    # it (rows selected by ctid, batches of 10,000)
    'delete from {table} where ctid in (select ctid from {table} where "Dispatched" = true '
    'and "DispatchedAt" < %(before)s limit 10000)'
)
GUARD_EXISTS = (
    "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'outbox_unpublished'::regclass "
    "AND tgname = 'outbox_unpublished_guard' AND NOT tgisinternal"
)
GUARD_TRIGGERS = (
    "SELECT tgrelid::regclass::text, tgname FROM pg_trigger "
    "WHERE tgname LIKE 'outbox_unpublished_guard%' ORDER BY 1, 2"
)
BOTH = [
    ("outbox_new", "outbox_unpublished_guard"),
    ("outbox_unpublished", "outbox_unpublished_guard"),
]


def _function_exists(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("SELECT to_regproc('public.outbox_unpublished_guard')").fetchone()
    return row is not None and row[0] is not None


@pytest.mark.pg_all
@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "guard-off"])
def test_nservicebus_ctid_cleanup_deletes_dispatched_rows_and_no_unsent_one(
    dsn: str, roles: DocumentedRoles, guard: bool
) -> None:
    """HOPER through V4 as the owner; then NServiceBus, as the application's role, stores
    five messages it has not dispatched, five it dispatches (its own UPDATE, which moves them
    to the published partition at the unsent rows' ctids), and runs its ctid cleanup. Guarded,
    the cleanup removes the five dispatched rows only; with `unpublished_guard = false` the
    migration builds no guard and the five unsent messages are gone (the defect)."""
    settings = NSERVICEBUS.spec_settings(
        accept_lost_unique=["sales_outboxdata_pkey"], unpublished_guard=guard
    )
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        owner.execute(NSERVICEBUS.ddl)
        owner.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON sales_outboxdata TO {}").format(
                sql.Identifier(roles.app)
            )
        )
    for phase in ("V2", "V3", "V4"):
        with Runner(roles.owner_dsn, settings, "hoper") as runner:
            runner.run(phase)
    table = sql.Identifier("public", "outbox_new")

    def run(conn: psycopg.Connection[Any], statement: str, **params: Any) -> Any:
        return conn.execute(sql.SQL(statement).format(table=table), params)  # type: ignore[arg-type]

    with psycopg.connect(roles.app_dsn, autocommit=True) as app:
        unsent = [run(app, NSB_STORE, n=n).fetchone()[0] for n in range(5)]
        sent = [run(app, NSB_STORE, n=n).fetchone()[0] for n in range(5, 10)]
        for message_id in sent:
            assert run(app, NSB_SET_AS_DISPATCHED, message_id=message_id).rowcount == 1
        # the premise: the dispatched rows sit at the unsent rows' ctids, in the other partition
        placed = run(app, 'SELECT tableoid::regclass::text, ctid::text, "MessageId" FROM {table}')
        where = {message_id: (rel, tid) for rel, tid, message_id in placed.fetchall()}
        assert {where[m][0] for m in sent} == {"sales_outboxdata"}  # the DEFAULT since V4
        assert {where[m][0] for m in unsent} == {"outbox_unpublished"}
        assert {where[m][1] for m in sent} == {where[m][1] for m in unsent}
        deleted = run(app, NSB_CTID_CLEANUP, before="infinity").rowcount
        left = run(app, 'SELECT "MessageId", "Dispatched" FROM {table}').fetchall()
        guards = app.execute(GUARD_EXISTS).fetchone()
    if guard:
        assert deleted == 10  # the five unsent rows it hit were written back
        assert sorted(left) == sorted((m, False) for m in unsent)
        assert guards == (1,)
    else:
        assert deleted == 10  # every unsent message went with the dispatched ones
        assert left == []
        assert guards == (0,)


@pytest.mark.newest_pg_only
def test_marks_move_rows_and_our_sessions_delete_while_others_are_guarded(
    dsn: str, roles: DocumentedRoles
) -> None:
    """HOP's V2 as the owner; as the application's role a plain UPDATE (a framework's own
    publisher) and our relay both mark, and every marked row moves out. A DELETE of an
    unpublished row — through the partitioned table or the partition — removes nothing from a
    plain session (the row is written back, whole), one row from our `db.connect` session (the
    relay's dead-letter path), and one row with the documented escape hatch."""
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_flat_outbox(owner)
        owner.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO {}").format(
                sql.Identifier(roles.app)
            )
        )
    with Runner(roles.owner_dsn, runner_settings(), "hop") as runner:
        runner.run("V2")
    with psycopg.connect(roles.app_dsn, autocommit=True) as app:
        insert_rows(app, "outbox_new", 300)
        marked = app.execute(
            "UPDATE outbox_new SET published_at = now() WHERE id IN "
            "(SELECT id FROM outbox_unpublished ORDER BY id LIMIT 100)"
        ).rowcount
        assert marked == 100
        published = "SELECT count(*) FROM outbox_new WHERE published_at IS NOT NULL"
        assert app.execute(published).fetchone() == (100,)
        unpublished = "SELECT * FROM outbox_unpublished ORDER BY id"
        before = app.execute(unpublished).fetchall()
        doomed = [r[0] for r in before]
        app.execute("DELETE FROM outbox_new WHERE id = %s", (doomed[0],))
        app.execute("DELETE FROM outbox_new WHERE published_at IS NULL")
        app.execute("DELETE FROM outbox_unpublished WHERE id = %s", (doomed[1],))
        assert app.execute(unpublished).fetchall() == before
        with app.transaction():
            app.execute("SET LOCAL outbox_migrate.unpublished_guard = off")
            assert app.execute("DELETE FROM outbox_new WHERE id = %s", (doomed[0],)).rowcount == 1
        # the escape hatch ended with its transaction
        app.execute("DELETE FROM outbox_new WHERE id = %s", (doomed[1],))
        assert app.execute(unpublished).fetchall() == before[1:]
    with connect(roles.app_dsn) as ours:
        assert ours.execute("DELETE FROM outbox_new WHERE id = %s", (doomed[1],)).rowcount == 1
    with Path(os.devnull).open("w") as devnull:
        relay = Relay(
            roles.app_dsn,
            lambda: StdoutSink(stream=devnull),
            spec=OutboxSpec(),
            options=RelayOptions(mode=Mode.partitioned, until_empty=True, listen=False,
                                 batch_size=64),
        )  # fmt: skip
        relay.run()
    assert relay.stats.published == 198
    with psycopg.connect(roles.app_dsn, autocommit=True) as app:
        counts = app.execute(
            "SELECT count(*) FILTER (WHERE published_at IS NULL), "
            "count(*) FILTER (WHERE tableoid = 'outbox_published'::regclass) FROM outbox_new"
        ).fetchone()
    assert counts == (0, 298)


@pytest.mark.newest_pg_only
def test_rollback_drops_the_guard_and_nothing_else_and_forward_builds_it_again(
    dsn: str, roles: DocumentedRoles
) -> None:
    """The guard step's inverse drops its trigger and function (recorded by OID when the
    step committed); a function of the operator's in the same schema stays; run again, the
    guard is back."""
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_flat_outbox(owner)
        owner.execute(
            "CREATE FUNCTION public.outbox_unpublished_audit() RETURNS trigger "
            "LANGUAGE plpgsql AS $$ BEGIN RETURN OLD; END $$"
        )
        with Runner(roles.owner_dsn, runner_settings(), "hop") as runner:
            runner.run("V2")
        assert owner.execute(GUARD_TRIGGERS).fetchall() == BOTH
        with Runner(roles.owner_dsn, runner_settings(), "hop") as runner:
            undone = runner.rollback("V1")
        assert "hop.v2.guard-unpublished" in undone
        assert not _function_exists(owner)
        assert owner.execute("SELECT to_regproc('public.outbox_unpublished_audit')").fetchone() \
            == ("outbox_unpublished_audit",)  # fmt: skip
        with Runner(roles.owner_dsn, runner_settings(), "hop") as runner:
            runner.run("V2")
        assert owner.execute(GUARD_TRIGGERS).fetchall() == BOTH
        assert _function_exists(owner)


@pytest.mark.newest_pg_only
def test_the_relay_dead_letters_a_row_through_the_guard(dsn: str, conn: psycopg.Connection) -> None:
    """After the swap, an unpublished row whose id the old table's primary key already holds
    cannot be marked: the relay dead-letters it by deleting it from the unpublished partition.
    Guarded, that DELETE is the relay's own (its session turns the guard off), so the row
    leaves and the drain ends; a plain session's DELETE of the same kind — here a superuser's,
    which row-level security would let through — removes nothing."""
    swapped_outbox(conn, [13], 30)
    for statement in guard.create_sql(Names(OutboxSpec())):
        conn.execute(statement)
    conn.execute("DELETE FROM outbox_unpublished WHERE id = 13")
    assert conn.execute("SELECT count(*) FROM outbox_unpublished WHERE id = 13").fetchone() == (1,)
    with Path(os.devnull).open("w") as devnull:
        relay = Relay(
            dsn,
            lambda: StdoutSink(stream=devnull),
            spec=OutboxSpec(),
            options=RelayOptions(mode=Mode.partitioned, until_empty=True, listen=False,
                                 batch_size=10, max_attempts=2),
        )  # fmt: skip
        relay.run()
    assert relay.stats.dead_lettered == 1 and relay.stats.published == 29
    assert conn.execute("SELECT count(*) FROM outbox_unpublished").fetchone() == (0,)
    assert conn.execute("SELECT id FROM outbox_dead_letter").fetchall() == [(13,)]


@pytest.mark.newest_pg_only
def test_a_migration_started_without_the_guard_gets_it_with_run_to_v2(dsn: str) -> None:
    """Started by a release without the guard (here: with it turned off) and past V3, the
    migration is told to finish V2 first; `run --to V2` then adds just the guard, and V4
    goes on as before."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    without = load_settings({"gate_window_s": 0.2, "unpublished_guard": False}, environ={})
    for phase in ("V2", "V3"):
        with Runner(dsn, without, "hoper") as runner:
            runner.run(phase)
    with Runner(dsn, runner_settings(), "hoper") as runner, pytest.raises(OutOfOrder):
        runner.run("V4")
    with Runner(dsn, runner_settings(), "hoper") as runner:
        assert runner.run("V2").ran == ["hoper.v2.guard-unpublished"]
    with Runner(dsn, runner_settings(), "hoper") as runner:
        assert runner.run("V4").phase == "V4"
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(GUARD_TRIGGERS).fetchall() == BOTH
