"""One way to count for both relays (relay/run_stats.py): the polling relay's RelayStats and the
CDC relay's CdcStats are Counters — thread-safe adds, and the same report of their own
counters only (the `relay.stopped` line, the CLI)."""

from __future__ import annotations

import threading

from outbox_migrate.relay.run_stats import CdcStats, Counters, RelayStats


def test_both_relays_count_the_same_way() -> None:
    for stats in (RelayStats(), CdcStats()):
        assert isinstance(stats, Counters)

        def add(stats: Counters = stats) -> None:
            for _ in range(2000):
                stats.add(published=1, batches=2)

        threads = [threading.Thread(target=add) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        counts = stats.as_dict()
        assert counts["published"] == 8000 and counts["batches"] == 16000
        assert not [k for k in counts if k.startswith("_")]


def test_each_reports_its_own_counters_in_order() -> None:
    shared = ["published", "batches", "sink_failures", "rejected", "bad_rows", "dead_lettered"]
    assert list(RelayStats().as_dict()) == [
        *shared, "serialization_retries", "connection_retries", "switches",
        "abandoned_workers", "read_ahead",
    ]  # fmt: skip
    assert list(CdcStats().as_dict()) == [
        *shared, "transactions", "backlog", "marked", "marks", "reconnects", "remarks",
        "idle_confirms", "confirmed_lsn",
    ]  # fmt: skip
    stats = RelayStats()
    stats.batch(7)
    assert (stats.published, stats.batches) == (7, 1)
