"""A relay started with the partitioned table's former name keeps publishing across the rename
to the original name (COP here: the shortest pattern with a partitioned outbox in use), and one
started afterwards with the original name publishes too.

Claims go to the unpublished partition, whose name does not change; marks go through the
former name, now a view, by ctid — which is why the view carries `ctid` (a plain view has no
system columns: the marks failed with "column ctid does not exist")."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.relay.options import Mode, RelayOptions
from outbox_migrate.relay.worker import Relay
from outbox_migrate.runner import Runner
from tests.integration.relay.conftest import Collected

SETTINGS: Any = load_settings({"gate_window_s": 0.1, "lock_budget_s": 10.0}, environ={})


def unpublished(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM outbox_unpublished").fetchone()
    assert row is not None
    return int(row[0])


def wait_drained(conn: psycopg.Connection, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while unpublished(conn) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert unpublished(conn) == 0


def test_relay_started_before_the_rename_publishes_through_the_view(
    dsn: str, collected: Collected
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        for phase in ("V2", "V3"):
            with Runner(dsn, SETTINGS, "cop", include_optional=True) as runner:
                runner.run(phase)
        relay = Relay(
            dsn,
            collected.factory(),
            spec=OutboxSpec(),  # partitioned_table = outbox_new: the former name
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
            insert_rows(conn, "outbox_new", 20)
            wait_drained(conn)
            with Runner(dsn, SETTINGS, "cop", include_optional=True) as runner:
                runner.run("original-name")
            insert_rows(conn, "outbox_new", 20)  # the previous version, through the view
            insert_rows(conn, "outbox", 20)  # the next version, on the original name
            wait_drained(conn)
        finally:
            relay.stop()
            thread.join(timeout=30)
        assert failure == []
        assert relay.stats.published == 60
        written = [r[0] for r in conn.execute("SELECT id FROM outbox ORDER BY id").fetchall()]
        assert sorted(collected.ids) == written and len(written) == 60

        # A relay of the next version names the original name (the flat table's name, unused
        # in partitioned mode, must differ from it).
        insert_rows(conn, "outbox", 10)
        renamed = OutboxSpec(table="outbox_retired", partitioned_table="outbox")
        after = Relay(
            dsn,
            collected.factory(),
            spec=renamed,
            options=RelayOptions(
                mode=Mode.partitioned, until_empty=True, listen=False, poll_interval_s=0.05
            ),
        )
        assert after.run().published == 10
        assert unpublished(conn) == 0
        # Both versions' relays name the outbox alike in their messages (the CloudEvents
        # source is /outbox/<that name>): a message sent again across the rename keeps its
        # (source, id). Before, the former name's relay sent public.outbox_new.
        assert {m.table for m in collected.messages} == {"public.outbox"}


def test_relay_with_the_original_name_is_woken_after_the_rename(
    dsn: str, collected: Collected
) -> None:
    """The rename re-keys the wake-up trigger to the original name: a relay started with it
    is woken by a plain INSERT instead of waiting for its (here 60 s) poll."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        for phase in ("V2", "V3", "original-name"):
            with Runner(dsn, SETTINGS, "cop", include_optional=True) as runner:
                runner.run(phase)
        relay = Relay(
            dsn,
            collected.factory(),
            spec=OutboxSpec(table="outbox_retired", partitioned_table="outbox"),
            options=RelayOptions(mode=Mode.partitioned, listen=True, poll_interval_s=60.0),
        )
        thread = threading.Thread(target=relay.run, daemon=True)
        thread.start()
        try:
            time.sleep(1.5)  # the relay found nothing and waits: idle, listening
            insert_rows(conn, "outbox", 5)
            wait_drained(conn, timeout_s=10.0)
        finally:
            relay.stop()
            thread.join(timeout=30)
        assert relay.stats.published == 5
