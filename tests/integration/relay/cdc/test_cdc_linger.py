"""The CDC relay's linger (`CdcOptions.linger_s`, `--linger-ms`) on real PostgreSQL.

A wake-up that finds a transaction to publish sleeps until `linger_s` after its first frame
arrived, then publishes everything complete as one batch: fewer wake-ups under a steady
stream, `linger_s` more latency for a lone insert, and no wait for a backlog.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import psycopg
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.relay.cdc.relay import READY_COMMENT, running
from outbox_migrate.relay.message import Message
from tests.integration.relay.conftest import SPEC, Collected, ids_in

from .conftest import cdc_relay, slot_row, wait_for

SLACK_S = 0.15
"""What a delivery may take beyond the linger on a loaded test machine (the idle loop's own
tick, 0.5 s, is what a stream that did not wake at once would add)."""


class Stamps:
    """The time (monotonic) and size of every batch the sink received."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.batches: list[tuple[float, int]] = []
        self.arrived = threading.Event()

    def __call__(self, batch: Sequence[Message]) -> None:
        self.batches.append((time.monotonic(), len(batch)))
        self.arrived.set()
        if self.delay_s:
            time.sleep(self.delay_s)  # a broker's acknowledgement round trip


def _single_row_transactions(dsn: str, count: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(count):
            conn.execute(
                "INSERT INTO outbox_new (payload, message_key) VALUES (%s, %s)",
                (f'{{"n": {i}}}', f"k-{i % 7}"),
            )


def _stream_active(conn: psycopg.Connection) -> bool:
    """The slot is in use and its first start's backlog is done (the slot is active while it
    is being created too: a relay stopped then leaves the backlog to be redone)."""
    done = conn.execute(
        "SELECT obj_description(oid, 'pg_publication') = %s FROM pg_publication "
        "WHERE pubname = 'outbox_migrate_cdc'",
        (READY_COMMENT.format(slot="outbox_migrate_cdc"),),
    ).fetchone()
    return bool((slot_row(conn) or (0, False))[1]) and bool(done and done[0])


def test_a_steady_stream_of_single_row_transactions_is_published_several_per_batch(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    relay = cdc_relay(dsn, collected.factory(), linger_s=0.02)
    with running(relay):
        wait_for(lambda: _stream_active(cdc_outbox), what="the stream")
        writers = [
            threading.Thread(target=_single_row_transactions, args=(dsn, 150)) for _ in range(2)
        ]
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        wait_for(lambda: len(collected.ids) >= 300, what="every row")
        wait_for(lambda: not ids_in(cdc_outbox, "outbox_unpublished"), what="the marks")
    stats = relay.stats
    assert stats.transactions == 300
    # Without the linger nearly every transaction was a batch of its own.
    assert stats.transactions / stats.batches > 2, (stats.transactions, stats.batches)
    assert collected.duplicates() == 0
    assert sorted(collected.ids) == ids_in(cdc_outbox, "outbox_new")
    assert stats.marked == 300


def test_a_lone_insert_into_an_idle_stream_is_delivered_after_the_linger(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """The idle stream wakes on the first packet (not at its next idle tick), lingers, and
    publishes: latency = linger + processing."""
    linger_s = 0.1
    stamps = Stamps()
    relay = cdc_relay(dsn, collected.factory(stamps), linger_s=linger_s)
    latencies = []
    # The walsender sends a commit once its WAL is flushed: without synchronous commit that
    # waits for the WAL writer (up to wal_writer_delay, 200 ms), which is not the relay's.
    cdc_outbox.execute("SET synchronous_commit = on")
    with running(relay):
        wait_for(lambda: _stream_active(cdc_outbox), what="the stream")
        for round_ in range(3):
            time.sleep(0.7)  # idle: the loop is waiting on the socket (idle tick 0.5 s)
            stamps.arrived.clear()
            insert_rows(cdc_outbox, "outbox_new", 1, spec=SPEC)
            committed = time.monotonic()
            assert stamps.arrived.wait(5), f"round {round_}: not delivered"
            latencies.append(stamps.batches[-1][0] - committed)
    assert len(collected.ids) == 3 and collected.duplicates() == 0
    assert relay.stats.batches == 3
    for latency in latencies:
        assert linger_s - 0.02 <= latency <= linger_s + SLACK_S, latencies


def test_a_backlog_publishes_full_batches_without_waiting_for_the_linger(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """2,000 single-row transactions waiting in the slot, batches of 100, a linger of one
    second and a broker taking 10 ms per batch: every batch is full and the twenty of them
    go out in far less than one linger (each full batch is published as it completes, and
    what the socket already holds is read before any linger)."""
    first = cdc_relay(dsn, collected.factory())
    with running(first):  # creates the slot; the backlog then piles up behind it
        wait_for(lambda: _stream_active(cdc_outbox), what="the stream")
    # Flushed as committed: the walsender sends only flushed WAL, and the WAL writer would
    # hand over the tail later (a pause in the stream, not a backlog).
    cdc_outbox.execute("SET synchronous_commit = on")
    cdc_outbox.execute(  # one transaction per row
        "DO $$ BEGIN FOR i IN 1..2000 LOOP "
        "INSERT INTO outbox_new (payload) VALUES (json_build_object('n', i)); COMMIT; "
        "END LOOP; END $$"
    )
    stamps = Stamps(delay_s=0.01)
    relay = cdc_relay(dsn, collected.factory(stamps), batch_size=100, linger_s=1.0)
    with running(relay):
        wait_for(lambda: len(collected.ids) >= 2000, what="the backlog")
    t0 = stamps.batches[0][0]
    timeline = [(round(t - t0, 3), size) for t, size in stamps.batches]
    assert [size for _, size in stamps.batches] == [100] * 20, timeline
    # A batch that waited for the linger (1 s, the most it may be) would stand a whole second
    # after the one before it; on a quiet machine the gaps are one broker round trip (10 ms)
    # each, ~0.2 s in all (a loaded CI machine has shown one pause of 0.63 s).
    gaps = [b[0] - a[0] for a, b in zip(stamps.batches, stamps.batches[1:], strict=False)]
    assert max(gaps) < 0.9, f"a batch waited {max(gaps):.3f} s: {timeline}"
    span = stamps.batches[-1][0] - stamps.batches[0][0]
    assert span < 1.2, f"20 batches took {span:.3f} s, more than one linger"
    assert relay.stats.transactions == 2000 and relay.stats.batches == 20
    assert collected.duplicates() == 0
    assert sorted(collected.ids) == ids_in(cdc_outbox, "outbox_new")
