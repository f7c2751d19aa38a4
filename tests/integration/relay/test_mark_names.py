"""A mark names the row it claimed: by ctid *within the relation it was claimed from*.

HOP with the rename to the original name, a relay of the next version started with
`--partitioned-table outbox` (as the phase's note says), then the names moved back under it —
here by hand, as an earlier release's rollback did it, so that `outbox` means the flat table
again and holds an unsent row at the very ctid of the row the relay claims from the
unpublished partition. The relay's mark went through the name `outbox` by ctid alone: it
marked the flat table's unsent row published (a message lost) and re-published its own row
every batch for ever. Now the mark is confined to the claimed relation (`tableoid`), changes
nothing, and the relay stops with one line. The roles are the documented ones: the runner as
the table's (non-superuser) owner, the relay as the application's role."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox
from psycopg import sql

from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.errors import NamesMoved
from outbox_migrate.relay.options import Mode, RelayOptions
from outbox_migrate.relay.worker import Relay
from outbox_migrate.runner import Runner
from tests.support.roles import DocumentedRoles

from .conftest import Collected

SETTINGS: Any = load_settings({"gate_window_s": 0.1, "lock_budget_s": 10.0}, environ={})
NEXT_VERSION = OutboxSpec(table="outbox_retired", partitioned_table="outbox")


def ctid_and_published(conn: psycopg.Connection, table: str) -> list[tuple[str, bool]]:
    query = sql.SQL("SELECT ctid::text, published_at IS NOT NULL FROM {} ORDER BY id")
    return [(str(r[0]), bool(r[1])) for r in conn.execute(query.format(sql.Identifier(table)))]


def test_a_mark_never_reaches_a_row_of_another_table(
    dsn: str, roles: DocumentedRoles, collected: Collected
) -> None:
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_flat_outbox(owner)
        owner.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE ON outbox TO {}").format(
                sql.Identifier(roles.app)
            )
        )
        for phase in ("V2", "V3", "original-name"):
            with Runner(roles.owner_dsn, SETTINGS, "hop", include_optional=True) as runner:
                runner.run(phase)
        relay = Relay(
            roles.app_dsn,
            collected.factory(),
            spec=NEXT_VERSION,
            options=RelayOptions(mode=Mode.partitioned, listen=False, poll_interval_s=0.05),
        )
        failure: list[BaseException] = []

        def run() -> None:
            try:
                relay.run()
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            time.sleep(0.5)  # started: its names resolved, nothing to claim yet
            # The names move back under the running relay, as an earlier release's rollback
            # of the rename did (no seal on the flat table).
            owner.execute("DROP VIEW outbox_new")
            owner.execute("ALTER TABLE outbox RENAME TO outbox_new")
            owner.execute("ALTER TABLE outbox_retired DROP CONSTRAINT IF EXISTS outbox_is_retired")
            owner.execute("ALTER TABLE outbox_retired RENAME TO outbox")
            # An unsent row in the flat table, and one in the unpublished partition: both
            # tables never held a row, so both rows are at ctid (0,1).
            owner.execute("INSERT INTO outbox (event_type, payload) VALUES ('flat', '{}')")
            owner.execute("INSERT INTO outbox_new (event_type, payload) VALUES ('new', '{}')")
            assert ctid_and_published(owner, "outbox") == [("(0,1)", False)]
            assert ctid_and_published(owner, "outbox_unpublished") == [("(0,1)", False)]
            thread.join(timeout=30)
        finally:
            relay.stop()
            thread.join(timeout=30)
        # The flat table's unsent row is not marked; the claimed row stays unpublished (sent,
        # so it is sent again by a relay with the right names: a duplicate, never a loss).
        assert ctid_and_published(owner, "outbox") == [("(0,1)", False)]
        assert ctid_and_published(owner, "outbox_unpublished") == [("(0,1)", False)]
        assert not thread.is_alive()
        assert len(failure) == 1 and isinstance(failure[0], NamesMoved), failure
        message = str(failure[0])
        assert "\n" not in message and '"public"."outbox"' in message
        assert collected.duplicates() == 0  # it stopped after its first batch


@pytest.mark.newest_pg_only
def test_names_checked_as_the_rename_and_the_views_drop_change_them(dsn: str) -> None:
    """What each relay's regular look at its names says across the rename (COP): a relay
    started with the former name still reaches its rows through the view, and one of the
    original name through the table; once the view is dropped, the former name reaches
    nothing and that relay stops with one line."""
    from dataclasses import replace

    from outbox_migrate.relay import queries
    from outbox_migrate.relay.marker_source import check_names

    def resolved(
        conn: psycopg.Connection, spec: OutboxSpec, *, flat: bool = False
    ) -> queries.Source:
        source = (queries.flat_source if flat else queries.partitioned_source)(spec)
        claim = queries.qualified(source.schema, source.claim_table)
        row = conn.execute("SELECT to_regclass(%s)::oid::int8", (claim,)).fetchone()
        assert row is not None
        return replace(source, claim_oid=int(row[0]))

    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        for phase in ("V2", "V3"):
            with Runner(dsn, SETTINGS, "cop", include_optional=True) as runner:
                runner.run(phase)
        former = resolved(conn, OutboxSpec())
        with Runner(dsn, SETTINGS, "cop", include_optional=True) as runner:
            runner.run("original-name")
        following = resolved(conn, NEXT_VERSION)
        assert following.claim_oid == former.claim_oid
        check_names(conn, former)  # through the view outbox_new
        check_names(conn, following)
        with Runner(dsn, SETTINGS, "cop", include_optional=True) as runner:
            runner.run("drop-view")
        check_names(conn, following)
        with pytest.raises(NamesMoved, match=r'"public"."outbox_new" no longer reaches'):
            check_names(conn, former)
        flat = resolved(conn, NEXT_VERSION, flat=True)  # the retired flat table, by name
        check_names(conn, flat)
        conn.execute("ALTER TABLE outbox_retired RENAME TO outbox_old")
        conn.execute("CREATE TABLE outbox_retired (LIKE outbox_old)")
        with pytest.raises(NamesMoved, match="no longer names the table it claimed from"):
            check_names(conn, flat)


@pytest.mark.newest_pg_only
def test_an_idle_relay_whose_claim_relation_is_renamed_away_stops(
    dsn: str, collected: Collected
) -> None:
    """Nothing to mark, so no mark can fall short: the relay's regular look at its names (every
    NAMES_CHECK_S, from its main thread) stops it once its unpublished partition is renamed
    away and another table takes the name, instead of idling on the wrong table for ever."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        for phase in ("V2", "V3"):
            with Runner(dsn, SETTINGS, "hop") as runner:
                runner.run(phase)
        relay = Relay(
            dsn,
            collected.factory(),
            spec=OutboxSpec(),
            options=RelayOptions(mode=Mode.partitioned, listen=True, poll_interval_s=0.2),
        )
        failure: list[BaseException] = []

        def run() -> None:
            try:
                relay.run()
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            time.sleep(0.5)
            with conn.transaction():  # one swap: no instant without the name
                conn.execute("ALTER TABLE outbox_unpublished RENAME TO outbox_unpublished_moved")
                conn.execute("CREATE TABLE outbox_unpublished (LIKE outbox_new)")
            thread.join(timeout=20)
        finally:
            relay.stop()
            thread.join(timeout=30)
        assert len(failure) == 1 and isinstance(failure[0], NamesMoved), failure
        assert "no longer names the table it claimed from" in str(failure[0])
