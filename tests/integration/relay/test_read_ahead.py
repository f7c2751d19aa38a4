"""The read-ahead session on real PostgreSQL: the next batch claimed on a worker's second
session while one is published (relay/read_ahead.py) — and every way out of a chain of such
batches: a backlog that ends, a rejection, the second session killed, a stop."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.errors import MessagesRejected
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Mode, Ordering, RelayOptions
from outbox_migrate.relay.worker import Relay

from .conftest import SPEC, Collected, ids_in


def relay_for(dsn: str, collected: Collected, fail=None, **options) -> Relay:
    return Relay(
        dsn,
        collected.factory(fail),
        spec=SPEC,
        options=RelayOptions(until_empty=True, listen=False, poll_interval_s=0.05, **options),
    )


def relay_backends(conn: psycopg.Connection) -> list[int]:
    """Server pids of the relay's sessions other than our own."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE '%relay%' "
        "AND pid <> pg_backend_pid() AND datname = current_database()"
    ).fetchall()
    return [r[0] for r in rows]


def locked_rows(conn: psycopg.Connection) -> int:
    """Row locks other sessions hold on the outbox (a transaction left open would hold some)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        "WHERE c.relname LIKE 'outbox%%' AND l.pid <> pg_backend_pid() "
        "AND l.mode = 'RowShareLock'"
    ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("mode", [Mode.partitioned, Mode.flat])
def test_a_backlog_is_claimed_ahead_and_published_once_in_id_order(
    dsn: str, conn: psycopg.Connection, collected: Collected, mode: Mode
) -> None:
    from outbox_migrate_harness.testing.schema import create_flat_outbox, create_partitioned_outbox

    if mode is Mode.flat:
        create_flat_outbox(conn, SPEC)
        table = "outbox"
    else:
        create_partitioned_outbox(conn, SPEC, start=1_000_001)
        table = "outbox_new"
    insert_rows(conn, table, 2_050, spec=SPEC)
    sessions: list[int] = []

    def watch(batch: Sequence[Message]) -> None:
        sessions.append(len(relay_backends(conn)))

    relay = relay_for(dsn, collected, watch, mode=mode, batch_size=100)
    relay.run()
    expected = ids_in(conn, table)
    assert collected.ids == expected  # one worker: exactly id order, each id once
    assert relay.stats.published == 2_050
    # 21 batches; every full one but the first was claimed ahead of its predecessor's mark.
    assert relay.stats.read_ahead >= 15, relay.stats
    assert max(sessions) == 2  # the lease session and the read-ahead session
    if mode is Mode.flat:
        assert ids_in(conn, table, published=False) == []
    else:
        assert ids_in(conn, "outbox_unpublished") == []


def test_no_read_ahead_when_switched_off_or_ordered(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(partitioned, "outbox_new", 600, spec=SPEC)
    relay = relay_for(dsn, collected, batch_size=50, read_ahead=False)
    relay.run()
    assert relay.stats.published == 600 and relay.stats.read_ahead == 0
    insert_rows(partitioned, "outbox_new", 600, spec=SPEC)
    relay = relay_for(dsn, collected, batch_size=50, ordering=Ordering.global_)
    relay.run()
    assert relay.stats.published == 600 and relay.stats.read_ahead == 0
    assert collected.duplicates() == 0


def test_a_rejection_rolls_back_the_batch_claimed_ahead(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """The batch after a rejected message was already claimed on the other session: it is
    rolled back unpublished and claimed again after the rewind, so nothing is published
    twice and nothing stays locked."""
    insert_rows(partitioned, "outbox_new", 1_000, spec=SPEC)
    poison = ids_in(partitioned, "outbox_new")[250]
    refused = {"n": 0}

    def reject_once(batch: Sequence[Message]) -> None:
        if refused["n"] == 0 and any(m.id == poison for m in batch):
            refused["n"] += 1
            collected.add([m for m in batch if m.id != poison])
            raise MessagesRejected("collect", {poison: "try later"})

    relay = relay_for(dsn, collected, reject_once, batch_size=100, backoff_base_s=0.01)
    relay.run()
    assert refused["n"] == 1
    assert relay.stats.read_ahead > 0
    assert Counter(collected.ids) == Counter(ids_in(partitioned, "outbox_new"))  # each once
    assert ids_in(partitioned, "outbox_unpublished") == []
    assert locked_rows(partitioned) == 0


def test_the_read_ahead_session_killed_mid_backlog_loses_nothing(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """The server ends the read-ahead session while it holds a claimed batch: the worker
    drops both sessions, reconnects and publishes everything; what was published but not
    marked comes again (at-least-once), nothing is lost."""
    insert_rows(partitioned, "outbox_new", 3_000, spec=SPEC)
    killed = {"n": 0}
    observer = psycopg.connect(dsn, autocommit=True)

    def kill_read_ahead(batch: Sequence[Message]) -> None:
        if killed["n"] == 0 and len(collected.ids) >= 1_000:
            # The read-ahead session is the relay's session that holds no advisory lock.
            victims = observer.execute(
                "SELECT a.pid FROM pg_stat_activity a WHERE a.application_name LIKE '%relay%' "
                "AND a.datname = current_database() AND a.pid <> pg_backend_pid() AND NOT "
                "EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory')"
            ).fetchall()
            for (pid,) in victims:
                observer.execute("SELECT pg_terminate_backend(%s)", (pid,))
            killed["n"] = len(victims)

    try:
        relay = relay_for(dsn, collected, kill_read_ahead, batch_size=100, backoff_base_s=0.01)
        relay.run()
    finally:
        observer.close()
    assert killed["n"] == 1
    assert relay.stats.connection_retries >= 1
    expected = ids_in(partitioned, "outbox_new")
    assert sorted(set(collected.ids)) == expected  # nothing lost
    assert collected.duplicates() <= 200  # at most the batches in flight on the two sessions
    assert ids_in(partitioned, "outbox_unpublished") == []
    assert locked_rows(partitioned) == 0


def test_a_stop_in_the_middle_of_a_chain_commits_what_was_published(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """A stop while a batch is claimed ahead: the published batch is marked and committed,
    the one claimed ahead is rolled back, both sessions end with nothing held, and the
    count of published messages is exactly what the database marked."""
    insert_rows(partitioned, "outbox_new", 5_000, spec=SPEC)
    relay_box: list[Relay] = []

    def stop_after_some(batch: Sequence[Message]) -> None:
        if len(collected.ids) >= 1_200:
            relay_box[0].stop()

    relay = Relay(
        dsn,
        collected.factory(stop_after_some),
        spec=SPEC,
        options=RelayOptions(listen=False, poll_interval_s=0.05, batch_size=100),
    )
    relay_box.append(relay)
    thread = threading.Thread(target=relay.run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    marked = ids_in(partitioned, "outbox_published")
    assert relay.stats.read_ahead > 0
    assert collected.ids == marked  # published = marked, in order, nothing more
    assert relay.stats.published == len(marked)
    assert locked_rows(partitioned) == 0
    assert relay_backends(partitioned) == []  # both sessions closed
