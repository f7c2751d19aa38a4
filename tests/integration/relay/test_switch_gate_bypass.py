"""The privilege switch gate and writers no REVOKE stops (superusers, the table's owner).

Found in the field: an application writing as a superuser passed the gate at once — the relay
switched 70 ms after it started while a V1 writer still inserted, and the rows that writer
added afterwards were stranded. Now such a session keeps the gate shut, says why at WARNING
(once, not at every check), and the relay switches only on evidence that holds.
"""

from __future__ import annotations

import logging
import time
import uuid

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import (
    create_flat_outbox,
    create_partitioned_outbox,
    insert_rows,
)
from psycopg import sql

from outbox_migrate.relay import switching
from outbox_migrate.relay.options import Mode, RelayOptions, SwitchGate
from outbox_migrate.relay.worker import Relay, running
from outbox_migrate.relay.writer import WritePhase
from tests.support.roles import DocumentedRoles

from .conftest import PARTITIONED_START, SPEC, Collected, ids_in
from .test_switching import Writers, wait_for

HELD_S = 1.5
"""How long the gate must keep the relay on the flat table while the superuser writes."""


@pytest.fixture
def tables(dsn: str) -> str:
    """Both outboxes, set up by a superuser session that is closed again (a superuser session
    left open would itself keep the gate shut)."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        create_flat_outbox(admin, SPEC)
        create_partitioned_outbox(admin, SPEC, start=PARTITIONED_START)
        insert_rows(admin, "outbox", 100, spec=SPEC)
    return dsn


def unpublished_flat(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return ids_in(conn, "outbox", published=False)


def switching_relay(dsn: str, collected: Collected, old_app: str = "") -> Relay:
    return Relay(
        dsn, collected.factory(), spec=SPEC,
        options=RelayOptions(
            mode=Mode.switching, batch_size=50, listen=False, poll_interval_s=0.02,
            switch_gate=SwitchGate.privilege, old_app_name=old_app,
        ),
    )  # fmt: skip


def test_a_superuser_writer_does_not_get_past_the_switch_gate(
    tables: str, collected: Collected, caplog: pytest.LogCaptureFixture
) -> None:
    dsn = tables
    v1 = Writers()  # the superuser the test server runs as: no role holds INSERT otherwise
    v1.start(dsn, WritePhase.flat, count=1, application_name="orders-v1")
    relay = switching_relay(dsn, collected)
    try:
        with caplog.at_level(logging.INFO, logger="outbox_migrate.relay"), running(relay):
            wait_for(lambda: relay.state.blocked_checks >= 3, what="blocked switch checks")
            time.sleep(HELD_S)
            assert not relay.state.switched, "switched while a superuser still inserts"
            assert "privilege gate proves nothing" in relay.state.last_blocked_reason
            assert "--old-app-name" in relay.state.last_blocked_reason
            checks = relay.state.blocked_checks
            v1.finish()
            wait_for(lambda: relay.state.switched, what="the switch once the writer is gone")
            wait_for(lambda: not unpublished_flat(dsn), 10, "no stranded V1 row")
    finally:
        v1.finish()
    assert checks > 3
    said = [r for r in caplog.records if "privilege gate proves nothing" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING]  # many checks, one WARNING
    assert {i for _, i in v1.inserted} <= set(collected.ids)


def test_with_old_app_name_it_waits_for_the_old_sessions_and_a_quiet_table(
    tables: str,
    collected: Collected,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A superuser's idle session stays (a DBA's psql): once V1's sessions are gone the gate
    still wants the flat table's insert counter to stand still for the window."""
    monkeypatch.setattr(switching, "QUIET_WINDOW_S", 1.0)
    dsn = tables
    v1 = Writers()
    v1.start(dsn, WritePhase.flat, count=1, application_name="orders-v1")
    relay = switching_relay(dsn, collected, old_app="orders-v1%")
    try:
        with (
            caplog.at_level(logging.INFO, logger="outbox_migrate.relay"),
            psycopg.connect(dsn, autocommit=True, application_name="psql"),
            running(relay),
        ):
            wait_for(lambda: relay.state.blocked_checks >= 3, what="blocked switch checks")
            time.sleep(HELD_S)
            assert not relay.state.switched
            assert "session(s) of 'orders-v1%' connected" in relay.state.last_blocked_reason
            v1.finish()
            gone = time.monotonic()
            wait_for(lambda: relay.state.switched, what="the switch")
            assert time.monotonic() - gone >= 1.0  # the quiet window, after the last insert
            wait_for(lambda: not unpublished_flat(dsn), 10, "no stranded V1 row")
    finally:
        v1.finish()
    assert {i for _, i in v1.inserted} <= set(collected.ids)
    quiet = [r.getMessage() for r in caplog.records if "insert counter" in r.getMessage()]
    assert len(quiet) == 1 and "psql" in quiet[0]  # the DBA's session is named


def test_a_column_level_insert_grant_keeps_the_gate_shut(tables: str, collected: Collected) -> None:
    """INSERT granted on columns only (`GRANT INSERT (payload) …`) is INSERT all the same:
    the gate waits for it, and `REVOKE INSERT ON outbox` (the advice it prints) ends it."""
    dsn = tables
    role = f"app_cols_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
        admin.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(ident))
        admin.execute(sql.SQL("GRANT SELECT, INSERT (payload) ON outbox TO {}").format(ident))
    relay = switching_relay(dsn, collected)
    try:
        with running(relay):
            wait_for(lambda: relay.state.blocked_checks >= 3, what="blocked switch checks")
            time.sleep(HELD_S)
            assert not relay.state.switched, "switched while a role may still insert"
            assert f"REVOKE INSERT ON public.outbox FROM {role}" in relay.state.last_blocked_reason
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute(sql.SQL("REVOKE INSERT ON outbox FROM {}").format(ident))
            wait_for(lambda: relay.state.switched, what="the switch after the REVOKE")
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(ident))
            admin.execute(sql.SQL("DROP ROLE {}").format(ident))


@pytest.mark.newest_pg_only
def test_a_relay_role_that_cannot_see_the_owner_writing_does_not_switch(
    dsn: str, roles: DocumentedRoles, collected: Collected
) -> None:
    """The documented setup: the relay as its own role, a V1 instance writing as the table's
    owner. The owner's sessions show no backend_type to the relay's role; the gate counts
    them all the same and says which grant lets it tell (before, it saw no session and
    switched at once, stranding the owner's later rows)."""
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_flat_outbox(owner, SPEC)
        create_partitioned_outbox(owner, SPEC, start=PARTITIONED_START)
        insert_rows(owner, "outbox", 100, spec=SPEC)
    for table in ("outbox", "outbox_new", "outbox_unpublished"):
        roles.grant("SELECT, UPDATE", table, roles.relay)
    v1 = Writers()
    v1.start(roles.owner_dsn, WritePhase.flat, count=1, application_name="orders-v1")
    relay = switching_relay(roles.relay_dsn, collected)
    try:
        with running(relay):
            wait_for(lambda: relay.state.blocked_checks >= 3, what="blocked switch checks")
            time.sleep(HELD_S)
            assert not relay.state.switched, "switched while the owner still inserts"
            reason = relay.state.last_blocked_reason
            assert roles.owner in reason
            assert f"hidden from {roles.relay}" in reason
            assert f"GRANT pg_read_all_stats TO {roles.relay}" in reason
            roles.grant_stats(roles.relay)  # now it sees a client backend: still shut
            checks = relay.state.blocked_checks
            wait_for(lambda: relay.state.blocked_checks > checks + 2, what="more checks")
            assert not relay.state.switched
            assert "hidden" not in relay.state.last_blocked_reason
            assert roles.owner in relay.state.last_blocked_reason
            v1.finish()
            wait_for(lambda: relay.state.switched, what="the switch once the owner is gone")
            wait_for(lambda: not unpublished_flat(dsn), 10, "no stranded V1 row")
    finally:
        v1.finish()
    assert {i for _, i in v1.inserted} <= set(collected.ids)


@pytest.mark.newest_pg_only
def test_the_watch_shows_why_a_switching_relay_waits(tables: str, collected: Collected) -> None:
    """The relay records its reason in its session's application_name, which any role can
    read: `status --watch` shows it (here: a role still holds INSERT); once the REVOKE lets
    the relay switch, the mark is gone."""
    from outbox_migrate.cli import watch

    dsn = tables
    role = f"app_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
        admin.execute(sql.SQL("GRANT INSERT ON outbox TO {}").format(ident))
    relay = switching_relay(dsn, collected)
    try:
        # Looking as the watch does: a superuser's session of another name would itself be
        # a writer no REVOKE stops, and keep the switch back.
        with (
            running(relay),
            psycopg.connect(
                dsn, autocommit=True, application_name=watch.WATCH_APPLICATION_NAME
            ) as look,
        ):
            wait_for(lambda: relay.state.blocked_checks >= 2, what="blocked switch checks")
            waiting = watch.switching_relays(look)
            assert [w["waits"] for w in waiting] == ["privilege"]
            assert "REVOKE" in waiting[0]["why"]
            look.execute(sql.SQL("REVOKE INSERT ON outbox FROM {}").format(ident))
            wait_for(lambda: relay.state.switched, what="the switch after the REVOKE")
            assert watch.switching_relays(look) == []
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(ident))
            admin.execute(sql.SQL("DROP ROLE {}").format(ident))
