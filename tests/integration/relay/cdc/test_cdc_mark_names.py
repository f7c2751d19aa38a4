"""The CDC relay's mark (by id, through the partitioned table's name) is confined to the
unpublished partition it streams: when that name comes to mean another table under the
running relay — one holding an unsent row with the very id just streamed — the mark leaves
that row alone and the relay stops with one line. Before, it marked it published: a message
lost."""

from __future__ import annotations

import threading

import psycopg

from outbox_migrate.errors import NamesMoved
from tests.integration.relay.conftest import PARTITIONED_START, Collected

from .conftest import cdc_relay, wait_for


def test_a_cdc_mark_never_reaches_a_row_of_another_table(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    conn = cdc_outbox
    relay = cdc_relay(dsn, collected.factory(), mark_interval_s=0.05)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            relay.run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        conn.execute("INSERT INTO outbox_new (payload) VALUES ('{}')")
        wait_for(lambda: len(collected.ids) == 1, what="the first row")
        wait_for(
            lambda: not conn.execute("SELECT count(*) FROM outbox_unpublished").fetchone()[0],
            what="its mark",
        )
        # The name moves: the partitioned table is renamed away, and a flat table takes its
        # name with an unsent row carrying the id the next insert will get.
        nxt = PARTITIONED_START + 1
        conn.execute("ALTER TABLE outbox_new RENAME TO outbox_moved")
        conn.execute("CREATE TABLE outbox_new (LIKE outbox_moved INCLUDING DEFAULTS)")
        conn.execute("INSERT INTO outbox_new (id, payload) VALUES (%s, '{}')", (nxt,))
        conn.execute("INSERT INTO outbox_moved (payload) VALUES ('{}')")
        thread.join(timeout=30)
    finally:
        relay.stop()
        thread.join(timeout=30)
    assert collected.ids == [PARTITIONED_START, nxt]
    unsent = conn.execute("SELECT published_at FROM outbox_new WHERE id = %s", (nxt,)).fetchone()
    assert unsent == (None,)  # the other table's row is not marked
    assert len(failure) == 1 and isinstance(failure[0], NamesMoved), failure
    assert "\n" not in str(failure[0])
