"""The application as a least-privilege role, the migration as the table's owner.

The application's role has SELECT, INSERT and UPDATE on the old table (and USAGE on its serial
sequence) and nothing else; nobody writes a GRANT by hand during the migration. The runner,
as the owner, creates the partitioned outbox; V1 and V2 writers and the switching relay run as
the application's role through the switch (after the operator's REVOKE INSERT, the default
gate's signal), and every message is published; then V3's partitioned relay and writer, as
the same role, across V4's swap. HOPIA's copy trigger fires in the relay's
session after the switch and must not need the INSERT the relay's role no longer has.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from psycopg import sql

from outbox_migrate.config import load_settings
from outbox_migrate.patterns import build_pattern
from outbox_migrate.relay.options import Mode, RelayOptions, SwitchGate
from outbox_migrate.relay.worker import Relay, running
from outbox_migrate.relay.writer import WritePhase
from outbox_migrate.runner import Runner
from tests.support.roles import DocumentedRoles

from .conftest import SPEC, Collected, ids_in
from .test_switching import Writers, wait_for

SERIAL_OUTBOX = """
    CREATE TABLE outbox (
        id bigserial PRIMARY KEY, event_type text NOT NULL DEFAULT 'event',
        message_key text, payload json NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz);
    CREATE INDEX outbox_unpublished_ids ON outbox (id) WHERE published_at IS NULL
"""


def ids(dsn: str, table: str, *, published: bool | None = None) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return ids_in(conn, table, published=published)


def settings() -> Any:
    return load_settings({"gate_window_s": 0.2, "lock_budget_s": 10.0}, environ={})


@pytest.mark.parametrize(
    ("pattern", "id_kind"), [("hoper", "identity"), ("hop", "serial"), ("hopia", "identity")]
)
def test_least_privilege_app_runs_through_the_switch_with_no_hand_written_grant(
    dsn: str, roles: DocumentedRoles, collected: Collected, pattern: str, id_kind: str
) -> None:
    app = sql.Identifier(roles.app)
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        if id_kind == "serial":
            owner.execute(SERIAL_OUTBOX)
            owner.execute(sql.SQL("GRANT USAGE ON SEQUENCE outbox_id_seq TO {}").format(app))
        else:
            create_flat_outbox(owner, SPEC)
        owner.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE ON outbox TO {}").format(app))
        insert_rows(owner, "outbox", 50, spec=SPEC)
    v1, v2 = Writers(), Writers()
    v1.start(roles.app_dsn, WritePhase.flat, count=1, application_name="orders-v1")
    try:
        with Runner(roles.owner_dsn, settings(), pattern) as runner:
            runner.run("V2")
        relay = Relay(
            roles.app_dsn,
            collected.factory(),
            spec=SPEC,
            options=RelayOptions(
                mode=Mode.switching, batch_size=50, listen=False, poll_interval_s=0.02,
                switch_gate=SwitchGate.privilege,
            ),
        )  # fmt: skip
        with running(relay):
            v2.start(roles.app_dsn, WritePhase.partitioned, count=1, application_name="orders-v2")
            wait_for(lambda: relay.state.blocked_checks >= 1, what="a first drain")
            assert not relay.state.switched  # V1 still holds INSERT
            v1.finish()
            with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
                owner.execute(sql.SQL("REVOKE INSERT ON outbox FROM {}").format(app))
            wait_for(lambda: relay.state.switched, what="the switch")
            time.sleep(0.3)
            v2.finish()
            wait_for(lambda: not ids(dsn, "outbox_unpublished"), what="the V2 backlog")
    finally:
        v1.finish()
        v2.finish()
    written = {i for _, i in v1.inserted} | {i for _, i in v2.inserted}
    assert {i for _, i in v2.inserted}, "V2 must have written through the switch"
    assert not ids(dsn, "outbox", published=False)  # nothing stranded in the old table
    assert written <= set(collected.ids)
    assert set(collected.ids) == set(ids(dsn, "outbox")) | set(ids(dsn, "outbox_new"))
    assert collected.duplicates() == 0
    with Runner(roles.owner_dsn, settings(), pattern) as runner:
        assert runner.run("V3").phase == "V3"  # the V3 gate: nothing left behind
    # V3 on: the partitioned relay and a writer as the application's role, across V4's swap
    # of the old table in as the DEFAULT partition (where the pattern has one).
    steady, v3 = Collected(), Writers()
    relay = Relay(
        roles.app_dsn, steady.factory(), spec=SPEC,
        options=RelayOptions(mode=Mode.partitioned, listen=False, poll_interval_s=0.02),
    )  # fmt: skip
    try:
        with running(relay):
            v3.start(roles.app_dsn, WritePhase.partitioned, count=1, application_name="orders-v3")
            wait_for(lambda: len(steady.ids) >= 20, what="the partitioned relay publishing")
            if "V4" in [phase.name for phase in build_pattern(pattern).phases]:
                with Runner(roles.owner_dsn, settings(), pattern) as runner:
                    assert runner.run("V4").phase == "V4"
            v3.finish()
            wait_for(lambda: not ids(dsn, "outbox_unpublished"), what="the V3 backlog")
    finally:
        v3.finish()
    assert {i for _, i in v3.inserted} <= set(steady.ids)
    assert steady.duplicates() == 0
