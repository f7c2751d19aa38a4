"""Partitions across hosts: 3 relay hosts (network namespaces), writers at 550 msg/s, an HTTP
consumer of our own; one fault on host 1 per test. Asserts nothing is lost, every shard is
served again within the bound, no key is delivered out of order (first deliveries), and
duplicates stay within one batch per worker. Prints the figures (docs/relay.md quotes them).

Newest PostgreSQL only (the mechanisms are the same on every supported version). About 40 s
per fault.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import psycopg
import pytest
from outbox_migrate_harness.testing import server as pgserver

from outbox_migrate.patterns.notify import ADVISORY_NAMESPACE

from .bed import FAULTS, Bed, Consumer, Relay, analyse, start_relay, stop_relay

# The test bed's own HTTP consumer (tests/netns/bed.py), not the relay, sometimes leaves a
# socket of a connection a fault cut for the garbage collector, in spite of closing every
# connection it tracks; the warning that socket raises when collected says nothing about the
# relay, so it is not an error here (everywhere else in the suite it is).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

SHARDS = 12
BATCH = 50
SINK_TIMEOUT_S = 2.0
SESSION_TIMEOUT_S = 6.0
RATE_PER_S = 550
KEYS = 64
BEFORE_S, FAULT_S, AFTER_S = 5.0, 20.0, 4.0
RECOVERY_BOUND_S = 15.0
"""The issue's goal; the configuration above aims at T + a probe + a rebalance, about 9 s.
FAULT_S is longer than the bound, so a relay that keeps its shards until the fault heals fails."""


class Writer(threading.Thread):
    """Inserts RATE_PER_S rows a second (every 20 ms a statement of rate/50 rows) over KEYS keys."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.ids: list[int] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        per_tick = RATE_PER_S // 50
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                tick = time.monotonic()
                while not self.stop.is_set():
                    rows = conn.execute(
                        "INSERT INTO outbox_new (event_type, message_key, payload) "
                        "SELECT 'e', 'key-' || (random() * %s)::int, '{}' "
                        "FROM generate_series(1, %s) RETURNING id",
                        (KEYS - 1, per_tick),
                    ).fetchall()
                    self.ids.extend(int(r[0]) for r in rows)
                    tick += 0.02
                    time.sleep(max(0.0, tick - time.monotonic()))
        except BaseException as exc:  # reported by the test
            self.error = exc


def _shard_holders(conn: psycopg.Connection) -> dict[int, int]:
    """Shards held per session: the shard leases' own advisory locks only (the idle relay's
    wake-up flag is an exclusive two-key advisory lock too, under another key)."""
    key = f"{ADVISORY_NAMESPACE}:public.outbox_new"
    rows = conn.execute(
        "SELECT pid, count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 "
        "AND mode = 'ExclusiveLock' AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND classid::int8 = (hashtext(%s)::int8 & 4294967295) GROUP BY pid",
        (key,),
    ).fetchall()
    return {int(pid): int(n) for pid, n in rows}


def _wait(predicate, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_on_one_host(
    fault: str, bed_server: pgserver.Server, bed_database: str, tmp_path: Path
) -> None:
    consumer = Consumer()
    relays: list[Relay] = []
    writer = Writer(bed_server.dsn(bed_database))
    try:
        with Bed(3) as bed, psycopg.connect(bed_server.dsn(bed_database), autocommit=True) as db:
            for host in bed.hosts:
                dsn = (f"host={host.root_address} port={bed_server.port} user=postgres "
                       f"dbname={bed_database}")  # fmt: skip
                relays.append(
                    start_relay(
                        bed, host, dsn, consumer, tmp_path / f"relay{host.index}.log",
                        "--ordering", "key", "--shards", str(SHARDS), "--batch-size", str(BATCH),
                        "--sink-timeout", str(SINK_TIMEOUT_S),
                        "--session-timeout", str(SESSION_TIMEOUT_S),
                        "--sink-option", "retries=0", "--sink-option", "batch=true", "--poll-interval", "0.2",
                    )
                )  # fmt: skip
            # Every host joined and holds its fair share.
            _wait(lambda: sorted(_shard_holders(db).values()) == [4, 4, 4], 30)
            writer.start()
            time.sleep(BEFORE_S)
            target = bed.hosts[0]
            fault_at = time.time()
            if fault == "link_down":
                bed.link_down(target)
            elif fault == "packet_loss":
                bed.drop(target)
            elif fault == "sigstop":
                relays[0].process.send_signal(signal.SIGSTOP)
            else:
                bed.drop(target, port=consumer.port)
            time.sleep(FAULT_S)
            if fault == "sigstop":
                relays[0].process.send_signal(signal.SIGCONT)
            bed.heal(target)
            time.sleep(AFTER_S)
            writer.stop.set()
            writer.join(10)
            assert writer.error is None, writer.error
            inserted = list(writer.ids)
            _wait(lambda: not db.execute("SELECT 1 FROM outbox_unpublished LIMIT 1").fetchone(), 60)
            time.sleep(1.0)
            for relay in relays:
                stop_relay(relay)
    finally:
        writer.stop.set()
        for relay in relays:
            stop_relay(relay)
        consumer.close()
    figures = analyse(fault, inserted, consumer.snapshot(), fault_at)
    print("\n" + figures.line())
    elapsed_s = BEFORE_S + FAULT_S + AFTER_S
    assert figures.inserted >= RATE_PER_S * elapsed_s * 0.8  # the writers kept their rate
    assert figures.lost == 0
    assert figures.recover_s <= RECOVERY_BOUND_S, figures.line()
    assert figures.order_violations_first == 0, figures.line()
    # one batch per worker per fault at most is re-sent (the batch in flight when it struck)
    assert figures.duplicates <= 3 * BATCH, figures.line()
