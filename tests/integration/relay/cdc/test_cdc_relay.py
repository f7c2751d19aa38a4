"""`relay --mode cdc` on real PostgreSQL (every configured version, wal_level=logical).

The sink here is the in-memory CollectSink (a real sink: the relay's publish/ack contract);
the real brokers (NATS, Kafka protocol, Redis with a SIGKILL and a 30-s outage) are in
tests/integration/relay/sinks/test_cdc_brokers.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.errors import SinkUnavailable
from outbox_migrate.relay.cdc.relay import running
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.metrics import CdcObserver
from tests.integration.relay.conftest import SPEC, Collected, ids_in

from .conftest import cdc_relay, slot_row, wait_for

REPO = Path(__file__).resolve().parents[4]


def _insert_txn(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        insert_rows(conn, "outbox_new", rows, spec=SPEC)


def _transactions(dsn: str, count: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(count):
            conn.execute(
                "INSERT INTO outbox_new (payload, message_key) VALUES (%s, %s)",
                (f'{{"n": {i}}}', f"k-{i % 7}"),
            )


def test_every_insert_is_published_once_marked_and_the_mark_is_not_streamed(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(cdc_outbox, "outbox_new", 120, spec=SPEC)  # backlog before the slot exists
    relay = cdc_relay(dsn, collected.factory(), batch_size=200)
    with running(relay):
        wait_for(lambda: len(collected.ids) >= 120, what="the backlog")
        _transactions(dsn, 30)
        _insert_txn(dsn, 700)  # one transaction larger than a batch
        big = ids_in(cdc_outbox, "outbox_new")[-700:]
        writers = [threading.Thread(target=_transactions, args=(dsn, 100)) for _ in range(4)]
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        total = 120 + 30 + 700 + 400
        wait_for(lambda: len(collected.ids) >= total, what="every row")
        wait_for(lambda: not ids_in(cdc_outbox, "outbox_unpublished"), what="the marks")
    assert relay.stats.backlog == 120
    assert collected.duplicates() == 0  # the marks moved 1,250 rows: none came back as inserts
    assert sorted(collected.ids) == ids_in(cdc_outbox, "outbox_new")
    assert len(ids_in(cdc_outbox, "outbox_published")) == total
    # The 700-row transaction went out whole, in one batch, in id order.
    ids = collected.ids
    first = ids.index(big[0])
    assert ids[first : first + 700] == big
    assert relay.stats.marked == total


def test_the_slot_follows_the_server_while_only_other_tables_are_written(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    relay = cdc_relay(dsn, collected.factory())
    with running(relay):
        wait_for(lambda: (slot_row(cdc_outbox) or (0, False))[1], what="the stream")
        before = cdc_outbox.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        cdc_outbox.execute("CREATE TABLE other (v text)")
        for _ in range(4):
            cdc_outbox.execute(
                "INSERT INTO other SELECT repeat('x', 500) FROM generate_series(1, 5000)"
            )
        written = cdc_outbox.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)::int8", (before,)
        ).fetchone()[0]
        assert written > 5_000_000  # ~10 MB of WAL the outbox has no part in
        # Without the idle confirmation the slot would keep every byte of it.
        wait_for(lambda: slot_row(cdc_outbox)[2] < 200_000, 15, "the slot to follow the server")
    assert relay.stats.idle_confirms > 0
    assert collected.ids == []


def test_an_idle_relay_confirms_a_few_times_a_second_while_another_database_is_busy(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected, other_database: str
) -> None:
    """Another database commits single rows as fast as it can for 2 s; this outbox is idle.
    The walsender pings on every flush it reads past the confirmed position: the relay
    confirms at most every IDLE_CONFIRM_S (0.5 s), and the slot still follows. Fails before:
    each ping was confirmed (~130 a second measured under load)."""
    from outbox_migrate.relay.options import IDLE_CONFIRM_S

    relay = cdc_relay(dsn, collected.factory())
    with running(relay):
        wait_for(lambda: (slot_row(cdc_outbox) or (0, False))[1], what="the stream")
        time.sleep(0.6)
        before = relay.stats.idle_confirms
        started = time.monotonic()
        with psycopg.connect(other_database, autocommit=True) as busy:
            busy.execute("SET synchronous_commit = on")  # a flush per commit: a ping each
            while time.monotonic() - started < 2.0:
                busy.execute("INSERT INTO outbox_new (payload) VALUES ('{}')")
        confirms = relay.stats.idle_confirms - before
        seconds = time.monotonic() - started
        wait_for(lambda: slot_row(cdc_outbox)[2] < 100_000, 10, "the slot to follow the server")
    assert confirms <= seconds / IDLE_CONFIRM_S + 2, confirms
    assert collected.ids == []


def _peek(conn: psycopg.Connection) -> int:
    """Inserts the slot would send again (after its confirmed position)."""
    from outbox_migrate.relay.cdc import pgoutput

    wait_for(lambda: not slot_row(conn)[1], 10, "the walsender to exit")
    rows = conn.execute(
        "SELECT data FROM pg_logical_slot_peek_binary_changes('outbox_migrate_cdc', NULL, NULL, "
        "'proto_version', '1', 'publication_names', 'outbox_migrate_cdc')"
    ).fetchall()
    return sum(isinstance(pgoutput.decode(r[0]), pgoutput.Insert) for r in rows)


def test_a_broker_outage_confirms_nothing_past_the_last_acknowledged_batch(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    down = threading.Event()

    def fail(batch: Sequence[Message]) -> None:
        if down.is_set():
            raise SinkUnavailable("collect", "broker down (test)")

    relay = cdc_relay(dsn, collected.factory(fail), backoff_cap_s=0.2)
    with running(relay):
        wait_for(lambda: (slot_row(cdc_outbox) or (0, False))[1], what="the stream")
        _insert_txn(dsn, 100)
        wait_for(lambda: len(collected.ids) == 100, what="the first transaction")
        down.set()
        _insert_txn(dsn, 150)
        wait_for(lambda: relay.stats.sink_failures >= 3, what="retries while down")
    # Stopped while the broker was still down: the slot must give the 150 rows out again.
    assert _peek(cdc_outbox) == 150
    assert len(ids_in(cdc_outbox, "outbox_unpublished")) == 150
    down.clear()
    relay = cdc_relay(dsn, collected.factory(fail), until_caught_up=True)
    relay.run()
    assert sorted(collected.ids) == ids_in(cdc_outbox, "outbox_new")
    assert collected.duplicates() == 0
    assert _peek(cdc_outbox) == 0


def test_sink_back_offs_during_the_first_start_keep_the_slot(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker refuses the first start's backlog four times (after one batch went out):
    the relay backs off and goes on with the slot it created and the ids its snapshot showed.
    Fails before: every back-off dropped the slot and created a new one (five slots, each
    waiting for the transactions running at its creation)."""
    insert_rows(cdc_outbox, "outbox_new", 200, spec=SPEC)
    outages = [4]

    def flaky(batch: Sequence[Message]) -> None:
        if collected.batches >= 1 and outages[0]:
            outages[0] -= 1
            raise SinkUnavailable("collect", "broker down (test)")

    caplog.set_level("INFO", logger="outbox_migrate.relay")
    relay = cdc_relay(dsn, collected.factory(flaky), batch_size=50, backoff_cap_s=0.05)
    with running(relay):
        wait_for(lambda: not ids_in(cdc_outbox, "outbox_unpublished"), what="the backlog")
        _transactions(dsn, 5)
        wait_for(lambda: len(set(collected.ids)) == 205, what="the stream after it")
    created = [r for r in caplog.messages if r.startswith("relay.cdc_slot_created")]
    assert len(created) == 1, created
    assert relay.stats.sink_failures == 4 and relay.stats.backlog == 200
    assert sorted(set(collected.ids)) == ids_in(cdc_outbox, "outbox_new")
    assert collected.duplicates() == 0  # an unavailable batch reached nobody


def _confirmed(conn: psycopg.Connection) -> int:
    from outbox_migrate.relay.cdc import pgoutput

    row = slot_row(conn)
    assert row is not None
    return pgoutput.parse_lsn(str(row[0]))


def test_marks_run_behind_the_stream_and_the_slot_waits_for_them(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """A mark stuck behind a row lock: delivery goes on, the slot stays before the unmarked
    transaction; once the lock goes, one statement marks everything that piled up."""
    from outbox_migrate.relay.cdc import pgoutput

    relay = cdc_relay(dsn, collected.factory(), mark_interval_s=0.05)
    with running(relay):
        wait_for(lambda: (slot_row(cdc_outbox) or (0, False))[1], what="the stream")
        with psycopg.connect(dsn) as locker:  # not autocommit: holds its row lock
            with cdc_outbox.transaction():
                insert_rows(cdc_outbox, "outbox_new", 1, spec=SPEC)
                row = cdc_outbox.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
                before_commit = pgoutput.parse_lsn(row[0])
            first = ids_in(cdc_outbox, "outbox_new")[0]
            locker.execute("SELECT 1 FROM outbox_unpublished WHERE id = %s FOR UPDATE", (first,))
            wait_for(lambda: relay.stats.marks == 1, what="the first mark")
            _transactions(dsn, 50)
            # Delivered while the first mark waits for the lock.
            wait_for(lambda: len(collected.ids) == 51, 10, "delivery behind a stuck mark")
            time.sleep(0.5)  # ten mark intervals
            assert relay.stats.marked == 0
            assert relay.stats.marks == 1  # one mark in flight at a time
            assert _confirmed(cdc_outbox) <= before_commit
            assert len(ids_in(cdc_outbox, "outbox_unpublished")) == 51
        wait_for(lambda: not ids_in(cdc_outbox, "outbox_unpublished"), what="the marks")
        wait_for(lambda: relay.stats.marked == 51, what="the marks' results")
    assert relay.stats.marks == 2  # the 50 that piled up went out as one statement
    assert relay.stats.published == 51
    assert collected.duplicates() == 0
    assert _confirmed(cdc_outbox) > before_commit
    assert _peek(cdc_outbox) == 0  # stop() marked and confirmed everything delivered


def test_stop_marks_and_confirms_what_waited_for_the_next_mark(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """A mark interval longer than the test: the delivered rows wait unmarked and the slot
    unconfirmed until stop(), which marks them and confirms before it returns."""
    relay = cdc_relay(dsn, collected.factory(), mark_interval_s=600)
    with running(relay):
        wait_for(lambda: (slot_row(cdc_outbox) or (0, False))[1], what="the stream")
        _transactions(dsn, 20)
        wait_for(lambda: len(collected.ids) == 20, what="delivery")
        time.sleep(0.3)
        assert relay.stats.marks == 0
        assert len(ids_in(cdc_outbox, "outbox_unpublished")) == 20
    assert relay.stats.marks == 1
    assert relay.stats.marked == 20
    assert ids_in(cdc_outbox, "outbox_unpublished") == []
    assert _peek(cdc_outbox) == 0  # confirmed: nothing would be sent again


def test_a_first_start_stopped_during_its_backlog_is_redone_without_loss(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(cdc_outbox, "outbox_new", 300, spec=SPEC)
    holder: list = []

    def stop_after_first(batch: Sequence[Message]) -> None:
        if collected.batches >= 1:
            holder[0].stop()

    first = cdc_relay(dsn, collected.factory(stop_after_first), batch_size=100)
    holder.append(first)
    first.run()
    assert first.stats.backlog < 300
    second = cdc_relay(dsn, collected.factory(), batch_size=100, until_caught_up=True)
    second.run()
    assert second.stats.backlog == 300 - first.stats.backlog
    assert sorted(set(collected.ids)) == ids_in(cdc_outbox, "outbox_new")
    assert collected.duplicates() <= 100
    _insert_txn(dsn, 10)  # and the stream runs from the new slot
    third = cdc_relay(dsn, collected.factory(), until_caught_up=True)
    third.run()
    assert third.stats.published == 10 and third.stats.backlog == 0


def test_slot_lag_and_activity_reach_the_metrics_and_readiness(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    observer = CdcObserver(1, 3600.0)  # any retained byte is over the warning threshold
    relay = cdc_relay(dsn, collected.factory())
    relay.observer = observer
    with running(relay):
        wait_for(lambda: b"outbox_relay_slot_active 1.0" in observer.exposition(), 15, "gauge")
        cdc_outbox.execute("CREATE TABLE filler AS SELECT g FROM generate_series(1, 1000) g")
    text = observer.exposition().decode()
    assert "outbox_relay_slot_lag_bytes" in text and "outbox_relay_slot_lag_seconds" in text
    observer.slot(10_000_000, 0.0, True)
    assert observer.healthy()
    assert not observer.ready()
    observer.slot(0, 0.0, True)
    assert observer.ready()


@pytest.mark.pg(min=17)
def test_the_slot_is_a_failover_slot_on_17_and_later(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    cdc_relay(dsn, collected.factory(), until_caught_up=True).run()
    row = cdc_outbox.execute(
        "SELECT failover, plugin FROM pg_replication_slots WHERE slot_name = 'outbox_migrate_cdc'"
    ).fetchone()
    assert row == (True, "pgoutput")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "relay", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_cli_streams_until_caught_up_and_drop_slot_asks_first(
    dsn: str, cdc_outbox: psycopg.Connection
) -> None:
    insert_rows(cdc_outbox, "outbox_new", 5, spec=SPEC)
    ran = _cli("--mode", "cdc", "--sink", "stdout", "--until-empty", "--dsn", dsn)
    assert ran.returncode == 0, ran.stderr
    printed = [line for line in ran.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 5
    refused = _cli("--drop-slot", "--dsn", dsn)
    assert refused.returncode != 0
    assert "--yes" in refused.stdout + refused.stderr
    assert slot_row(cdc_outbox) is not None
    dropped = _cli("--drop-slot", "--yes", "--dsn", dsn)
    assert dropped.returncode == 0, dropped.stderr
    assert slot_row(cdc_outbox) is None
    assert cdc_outbox.execute("SELECT count(*) FROM pg_publication").fetchone() == (0,)
    counts = Counter(line.split(",")[0] for line in printed)
    assert all(c == 1 for c in counts.values())


def test_hand_off_polling_to_cdc_and_back_under_load_loses_nothing(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """Writers never stop: polling → CDC → polling, each relay stopped before the next
    starts. The CDC relay's first start publishes what its slot's exported snapshot shows
    unpublished; after a CDC stop the unpublished partition holds exactly what it did not
    confirm, and dropping the slot hands those rows to the polling relay."""
    from outbox_migrate.relay.cdc import slot
    from outbox_migrate.relay.options import RelayOptions
    from outbox_migrate.relay.worker import Relay
    from outbox_migrate.relay.worker import running as polling_running

    stop = threading.Event()

    def write() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                insert_rows(conn, "outbox_new", 3, spec=SPEC)

    def polling() -> Relay:
        options = RelayOptions(batch_size=50, listen=False, poll_interval_s=0.02)
        return Relay(dsn, collected.factory(), spec=SPEC, options=options)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        with polling_running(polling()):
            wait_for(lambda: len(collected.ids) > 300, what="polling")
        handed = len(collected.ids)
        cdc = cdc_relay(dsn, collected.factory(), batch_size=50)
        with running(cdc):
            wait_for(lambda: len(collected.ids) > handed + 600, what="cdc")
        assert cdc.stats.backlog > 0  # rows written between the two relays
        wait_for(lambda: not slot_row(cdc_outbox)[1], 10, "the walsender to exit")
        slot.drop_slot(cdc_outbox, "outbox_migrate_cdc")
        handed = len(collected.ids)
        with polling_running(polling()):
            wait_for(lambda: len(collected.ids) > handed + 300, what="polling again")
            stop.set()
            writer.join()
            wait_for(lambda: not ids_in(cdc_outbox, "outbox_unpublished"), what="the rest")
    finally:
        stop.set()
        writer.join()
    assert sorted(set(collected.ids)) == ids_in(cdc_outbox, "outbox_new")
    assert collected.duplicates() == 0  # graceful stops leave nothing in flight
