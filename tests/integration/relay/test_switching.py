"""Switching mode: drain the flat table, switch to the partitioned one exactly once.

The spec's sketch switches at the first empty batch; these tests keep V1 writers inserting
into the flat table after that first drain and prove that nothing is stranded, that the
switch happens once, and that id order holds across it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

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
from outbox_migrate.relay.writer import WritePhase, insert_message

from .conftest import PARTITIONED_START, SPEC, Collected, ids_in

WRITER_PAUSE_S = 0.003
QUIET_WINDOW_S = 0.3


@pytest.fixture(autouse=True)
def _short_quiet_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests keep a superuser session open (`both`): the privilege gate then proves
    nothing and waits for the old version's sessions to leave and the flat table to stay
    quiet for a window, shortened here so the tests stay fast."""
    monkeypatch.setattr(switching, "QUIET_WINDOW_S", QUIET_WINDOW_S)


@pytest.fixture
def both(conn: psycopg.Connection) -> psycopg.Connection:
    create_flat_outbox(conn, SPEC)
    create_partitioned_outbox(conn, SPEC, start=PARTITIONED_START)
    return conn


@pytest.fixture
def v1_role(both: psycopg.Connection) -> Iterator[str]:
    """A non-superuser login role that may INSERT into the flat table (the V1 application)."""
    name = f"app_v1_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(name)
    both.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
    both.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(ident))
    both.execute(sql.SQL("GRANT INSERT, SELECT ON outbox TO {}").format(ident))
    try:
        yield name
    finally:
        both.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,)
        )
        both.execute(sql.SQL("REVOKE ALL ON outbox FROM {}").format(ident))
        both.execute(sql.SQL("REVOKE ALL ON SCHEMA public FROM {}").format(ident))
        both.execute(sql.SQL("DROP ROLE {}").format(ident))


class Writers:
    """Application instances inserting one message per transaction until stopped."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.inserted: list[tuple[float, int]] = []
        self.lock = threading.Lock()

    def start(self, dsn: str, phase: WritePhase, count: int = 1, **connect_args: str) -> None:
        def write() -> None:
            try:
                with psycopg.connect(dsn, autocommit=True, **connect_args) as conn:
                    while not self.stop.is_set():
                        with conn.transaction():
                            new_id = insert_message(conn, {"v": phase.value}, phase=phase)
                        with self.lock:
                            self.inserted.append((time.monotonic(), new_id))
                        time.sleep(WRITER_PAUSE_S)
            except BaseException as exc:
                self.errors.append(exc)

        for _ in range(count):
            thread = threading.Thread(target=write)
            thread.start()
            self.threads.append(thread)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)
        assert not self.errors, self.errors


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def assert_order_across_switch(collected: Collected) -> None:
    ids = collected.ids
    flat_positions = [i for i, v in enumerate(ids) if v < PARTITIONED_START]
    partitioned_positions = [i for i, v in enumerate(ids) if v >= PARTITIONED_START]
    assert flat_positions and partitioned_positions
    assert max(flat_positions) < min(partitioned_positions)


@pytest.mark.parametrize("gate", [SwitchGate.privilege, SwitchGate.sessions])
def test_v1_writers_after_first_drain_are_not_stranded(
    dsn: str, both: psycopg.Connection, v1_role: str, collected: Collected, gate: SwitchGate
) -> None:
    insert_rows(both, "outbox", 200, spec=SPEC)
    v1, v2 = Writers(), Writers()
    v1.start(dsn, WritePhase.flat, count=2, user=v1_role, application_name="orders-v1")
    relay = Relay(
        dsn,
        collected.factory(),
        spec=SPEC,
        options=RelayOptions(
            mode=Mode.switching, batch_size=50, listen=False, poll_interval_s=0.02,
            switch_gate=gate, old_app_name="orders-v1%",
        ),
    )  # fmt: skip
    try:
        with running(relay):
            # The rolling deploy: V2 instances start writing to the partitioned table...
            v2.start(dsn, WritePhase.partitioned, count=1, application_name="orders-v2")
            # ...the relay drains the flat table for the first time, but V1 is still alive.
            # (An empty claim on the flat table is what triggers a switch check.)
            wait_for(
                lambda: relay.state.blocked_checks >= 1 or relay.state.switched,
                what="a first drain",
            )
            first_drain = time.monotonic()
            time.sleep(0.5)
            # V1 is gone: its instances stop; with the privilege gate the operator revokes.
            v1.finish()
            if gate is SwitchGate.privilege:
                both.execute(sql.SQL("REVOKE INSERT ON outbox FROM {}").format(
                    sql.Identifier(v1_role)))  # fmt: skip
            wait_for(lambda: relay.state.switched, what="the switch")
            time.sleep(0.3)
            v2.finish()
            wait_for(lambda: not ids_in(both, "outbox_unpublished"), what="the V2 backlog")
            wait_for(lambda: not ids_in(both, "outbox", published=False), 10, "no stranded V1 row")
    finally:
        v1.finish()
        v2.finish()
    after_first_drain = [i for t, i in v1.inserted if t > first_drain]
    assert after_first_drain, "V1 must have inserted after the first drain for this proof"
    assert set(after_first_drain) <= set(collected.ids)  # the naive switch would strand these
    assert set(collected.ids) == set(ids_in(both, "outbox")) | set(ids_in(both, "outbox_new"))
    assert collected.duplicates() == 0
    assert relay.state.switches == 1
    assert_order_across_switch(collected)


def test_an_open_v1_transaction_holds_the_switch_until_it_commits(
    dsn: str, both: psycopg.Connection, v1_role: str, collected: Collected
) -> None:
    """The gate already holds (INSERT revoked) but a V1 transaction that inserted before the
    revoke is still open: the SHARE lock cannot be granted, so the relay waits for it."""
    insert_rows(both, "outbox_new", 20, spec=SPEC)
    with psycopg.connect(dsn, user=v1_role) as v1:  # not autocommit: a transaction stays open
        late_id = insert_message(v1, {"late": True}, phase=WritePhase.flat, notify=None)
        both.execute(sql.SQL("REVOKE INSERT ON outbox FROM {}").format(sql.Identifier(v1_role)))
        relay = Relay(
            dsn, collected.factory(), spec=SPEC,
            options=RelayOptions(
                mode=Mode.switching, listen=False, poll_interval_s=0.02,
                old_app_name="orders-v1%",
            ),
        )  # fmt: skip
        with running(relay):
            wait_for(
                lambda: (
                    relay.state.last_blocked_reason == "a transaction is still writing the table"
                ),
                what="the switch blocked by the open transaction",
            )
            checks = relay.state.blocked_checks
            wait_for(lambda: relay.state.blocked_checks >= checks + 3, what="more blocked checks")
            assert not relay.state.switched
            assert relay.state.last_blocked_reason == "a transaction is still writing the table"
            assert collected.ids == []
            v1.commit()
            wait_for(lambda: relay.state.switched, what="the switch")
            wait_for(lambda: len(collected.ids) == 21, what="all messages")
    assert collected.ids[0] == late_id
    assert_order_across_switch(collected)
    assert relay.state.switches == 1


def test_a_v1_transaction_open_at_the_switch_holds_it_under_the_sessions_gate(
    dsn: str, both: psycopg.Connection, collected: Collected
) -> None:
    """A V1 transaction open while the relay would switch, one that has not inserted yet (no
    lock on the flat table shows it), keeps the relay on the flat table: under the `sessions`
    gate its session is what the gate sees. It inserts and commits late; the row is published
    from the flat table, first, and only then does the relay switch. The rows the operator
    fuzzer once found left in the flat table came from a V1 session opened after every V1
    session was gone (a reconnect, which this gate does not see by design), not from this."""
    insert_rows(both, "outbox_new", 5, spec=SPEC)
    v1 = psycopg.connect(dsn, application_name="orders-v1")  # not autocommit
    try:
        v1.execute("SELECT 1")  # the transaction is open; nothing inserted yet
        relay = Relay(
            dsn, collected.factory(), spec=SPEC,
            options=RelayOptions(
                mode=Mode.switching, listen=False, poll_interval_s=0.02,
                switch_gate=SwitchGate.sessions, old_app_name="orders-v1%",
            ),
        )  # fmt: skip
        with running(relay):
            wait_for(lambda: relay.state.blocked_checks >= 3, what="blocked switch checks")
            assert not relay.state.switched
            assert "'orders-v1%'" in relay.state.last_blocked_reason
            late_id = insert_message(v1, {"late": True}, phase=WritePhase.flat, notify=None)
            v1.commit()
            time.sleep(0.2)
            assert not relay.state.switched  # the session is still connected
            v1.close()
            wait_for(lambda: relay.state.switched, what="the switch")
            wait_for(lambda: len(collected.ids) == 6, what="all messages")
    finally:
        v1.close()
    assert collected.ids[0] == late_id
    assert not ids_in(both, "outbox", published=False)
    assert_order_across_switch(collected)
    assert relay.state.switches == 1


def test_switching_until_empty_exits_when_both_tables_are_empty(
    dsn: str, both: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(both, "outbox", 30, spec=SPEC)
    insert_rows(both, "outbox_new", 30, spec=SPEC)
    relay = Relay(
        dsn, collected.factory(), spec=SPEC,
        options=RelayOptions(
            mode=Mode.switching, until_empty=True, listen=False, batch_size=7,
            old_app_name="orders-v1%",
        ),
    )  # fmt: skip
    relay.run()
    # No role a REVOKE stops can insert; the test's superuser session is answered by the old
    # version's sessions being gone and the quiet window.
    assert relay.state.switches == 1
    assert collected.ids == ids_in(both, "outbox") + ids_in(both, "outbox_new")


def test_a_linger_does_not_hide_the_drained_flat_table_from_the_switch(
    dsn: str, both: psycopg.Connection, collected: Collected
) -> None:
    """Steady V1 traffic and a long linger: every lingered claim would find a row, so the
    flat table would never be seen empty and the switch never checked (a CI flake at the
    default 5 ms linger under load). On the flat table the switching relay does not linger."""
    v1 = Writers()
    v1.start(dsn, WritePhase.flat, count=2, application_name="orders-v1")
    relay = Relay(
        dsn, collected.factory(), spec=SPEC,
        options=RelayOptions(
            mode=Mode.switching, batch_size=50, listen=False, poll_interval_s=0.05,
            linger_s=0.05, switch_gate=SwitchGate.sessions, old_app_name="orders-v1%",
        ),
    )  # fmt: skip
    try:
        with running(relay):
            wait_for(lambda: relay.state.blocked_checks >= 3, 10.0, "switch checks while V1 writes")
            assert not relay.state.switched
            v1.finish()
            wait_for(lambda: relay.state.switched, what="the switch")
    finally:
        v1.finish()
    assert set(collected.ids) == set(ids_in(both, "outbox"))
    assert collected.duplicates() == 0
