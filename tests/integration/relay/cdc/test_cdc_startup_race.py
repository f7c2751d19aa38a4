"""Every row the CDC relay delivers is marked, even one it received before its commit was
visible to other sessions.

The stream carries a transaction once its commit record is flushed; the server makes it
visible to other sessions a moment later (and, with synchronous replication, only after the
standby answered). A mark sent in between does not see the row, and succeeded all the same:
the row was delivered, never marked, the slot confirmed past it — sent again by whatever read
the unpublished partition next (a new first start, a polling relay). Seen in 2 of 8 start-up
races under load. Here the moment is made as long as needed: the server waits for a
synchronous standby that does not exist, and the writer's session alone asks for it
(`synchronous_commit = on`; the server default is `local`), so its transaction is in the
stream and invisible until the test cancels the wait (it then commits locally).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import psycopg
import pytest
from outbox_migrate_harness.testing import server as pgserver
from outbox_migrate_harness.testing.schema import create_partitioned_outbox, insert_rows

from outbox_migrate.relay.cdc.relay import running
from outbox_migrate.relay.message import Message
from tests.integration.relay.conftest import SPEC, Collected

from .conftest import cdc_relay, drop_slots, wait_for

pytestmark = pytest.mark.newest_pg_only
RACES = 20
BACKLOG = 120
BATCH = 40


@pytest.fixture
def held_commits(pg_server: pgserver.Server) -> Iterator[str]:
    """A server of the same version whose commits wait for a synchronous standby that never
    comes — for sessions that ask for it; everyone else commits locally."""
    server = pgserver.start(
        pg_server.version,
        settings={"synchronous_standby_names": "nobody", "synchronous_commit": "local"},
    )
    try:
        yield server.dsn()
    finally:
        server.stop()


def _held_insert(dsn: str, race: int, pids: list[int]) -> None:
    """One row whose commit waits (in the stream, invisible to others) until cancelled."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")
        pids.append(conn.info.backend_pid)
        conn.execute(
            "INSERT INTO outbox_new (payload) VALUES (jsonb_build_object('held', %s::int))",
            (race,),
        )  # returns once cancelled, with a warning: committed locally


def _race(dsn: str, conn: psycopg.Connection, race: int) -> list[int]:
    """One first start: a backlog, and during it the held row and a few plain ones; the held
    row is let go once the stream delivered it and marks went out. Returns the ids delivered
    and left in the unpublished partition."""
    drop_slots(dsn)
    conn.execute("DROP PUBLICATION IF EXISTS outbox_migrate_cdc")
    conn.execute("TRUNCATE outbox_new")
    insert_rows(conn, "outbox_new", BACKLOG, spec=SPEC)
    collected = Collected()
    pids: list[int] = []
    writers: list[threading.Thread] = []

    def during_backlog(batch: Sequence[Message]) -> None:
        if writers:
            return
        writers.append(threading.Thread(target=_held_insert, args=(dsn, race, pids)))
        writers[0].start()
        with psycopg.connect(dsn, autocommit=True) as other:
            insert_rows(other, "outbox_new", 5, spec=SPEC)

    def held_delivered() -> bool:
        return any(f'"held": {race}' in str(m.payload) for m in collected.messages)

    relay = cdc_relay(dsn, collected.factory(during_backlog), batch_size=BATCH)
    with running(relay):
        wait_for(held_delivered, what="the held row, from the stream")
        time.sleep(0.25)  # marks go out meanwhile (every 0.1 s)
        conn.execute("SELECT pg_cancel_backend(%s)", (pids[0],))
        writers[0].join(10)
        wait_for(lambda: relay.stats.published >= BACKLOG + 6, what="every row")
        time.sleep(0.15)
    assert relay.stats.backlog == BACKLOG
    left = {r[0] for r in conn.execute("SELECT id FROM outbox_unpublished").fetchall()}
    return sorted(left.intersection(collected.ids))


def test_rows_received_before_their_commit_was_visible_are_marked(held_commits: str) -> None:
    """20 first starts, each with a row whose commit reaches the stream while it is still
    invisible to other sessions. Fails before the fix: the held row of every start was
    delivered and left unmarked."""
    with psycopg.connect(held_commits, autocommit=True) as conn:
        create_partitioned_outbox(conn, SPEC)
        unmarked = [
            (race, ids) for race in range(RACES) if (ids := _race(held_commits, conn, race))
        ]
        drop_slots(held_commits)
    assert unmarked == []
