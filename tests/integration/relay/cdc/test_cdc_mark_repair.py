"""A CDC mark that breaks a constraint is the failing row's problem, as in polling mode.

After the swap the old table, with its primary key, is the DEFAULT partition: a new row whose
id is already there cannot be moved by the mark. The mark is one `UPDATE … WHERE id = ANY(…)`
for everything acknowledged, so it failed for all of them, the relay stopped ("cannot mark
published rows"), and every restart re-streamed the same rows and stopped again: a crash
loop. Now the rest are marked, the failing rows counted, and at max attempts dead-lettered
with the SQLSTATE and removed; the slot is never confirmed past a row that is neither marked
nor dead-lettered (a kill meanwhile loses nothing).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_migrate.relay.cdc.relay import running
from tests.integration.relay.conftest import Collected, ids_in, swapped_outbox

from .conftest import cdc_relay, drop_slots, slot_row, wait_for

REPO = Path(__file__).resolve().parents[4]
DUPLICATE = 13


@pytest.fixture
def swapped(dsn: str, conn: psycopg.Connection) -> Any:
    """The swapped shape: `outbox` (PRIMARY KEY, id 13 published) is the DEFAULT partition
    of `outbox_new`; nothing unpublished yet (each test inserts its rows)."""
    conn.autocommit = True
    swapped_outbox(conn, [DUPLICATE], 0)
    try:
        yield conn
    finally:
        drop_slots(dsn)


def _insert(conn: psycopg.Connection, *rows: tuple[int, str]) -> None:
    with conn.transaction():
        for ident, payload in rows:
            conn.execute("INSERT INTO outbox_new (id, payload) VALUES (%s, %s)", (ident, payload))


def _dead(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT source_table, id, attempts, last_error, payload FROM outbox_dead_letter "
        "ORDER BY id, source_table"
    ).fetchall()


def _attempts(conn: psycopg.Connection, ident: int) -> int:
    try:
        row = conn.execute(
            "SELECT attempts FROM outbox_dead_letter_attempts WHERE id = %s AND "
            "source_table NOT LIKE 'cdc-run:%%'",
            (ident,),
        ).fetchone()
    except psycopg.errors.UndefinedTable:
        return 0
    return int(row[0]) if row else 0


def test_a_row_whose_mark_breaks_the_primary_key_is_dead_lettered_and_the_stream_goes_on(
    dsn: str, swapped: psycopg.Connection, collected: Collected
) -> None:
    conn = swapped
    _insert(conn, *((i, json.dumps({"n": i})) for i in range(1, 31)))  # the backlog
    first = cdc_relay(dsn, collected.factory(), max_attempts=2, until_caught_up=True)
    first.run()  # stopped with "cannot mark published rows" before
    assert ids_in(conn, "outbox_unpublished") == []
    assert ids_in(conn, "outbox") == list(range(1, 31))  # 13: the original only
    dead = _dead(conn)
    assert [(d[1], d[2]) for d in dead] == [(DUPLICATE, 2)], dead
    assert "SQLSTATE 23505" in dead[0][3] and "outbox_pkey" in dead[0][3]
    assert json.loads(dead[0][4]) == {"n": DUPLICATE}

    # Through the stream: 13 again (its dead letter is taken: kept as a copy), and two
    # unpublished copies of 35 in one transaction (the first is marked, the second is not).
    relay = cdc_relay(dsn, collected.factory(), max_attempts=2)
    with running(relay):
        _insert(conn, (31, '{"n": 31}'), (DUPLICATE, '{"again": 13}'), (32, '{"n": 32}'))
        _insert(conn, (35, '{"copy": 1}'), (35, '{"copy": 2}'), (36, '{"n": 36}'))
        _insert(conn, (40, '{"n": 40}'))
        wait_for(lambda: ids_in(conn, "outbox_unpublished") == [], what="every row settled")
        wait_for(lambda: _confirmed_past(conn), what="the slot confirmed past every row")
        assert relay.stats.sink_failures == 0
    published = ids_in(conn, "outbox")
    assert [i for i in (31, 32, 35, 36, 40) if published.count(i) != 1] == []
    dead = [(d[0], d[1], json.loads(d[4])) for d in _dead(conn)]
    assert dead == [
        ("public.outbox_new", DUPLICATE, {"n": DUPLICATE}),
        ("public.outbox_new copy 2", DUPLICATE, {"again": 13}),
        ("public.outbox_new", 35, {"copy": 2}),
    ], dead
    assert conn.execute("SELECT payload FROM outbox WHERE id = 35").fetchone() == ({"copy": 1},)
    assert conn.execute(
        "SELECT count(*) FROM outbox_dead_letter_attempts WHERE source_table NOT LIKE 'cdc-run:%'"
    ).fetchone() == (0,)


def _confirmed_past(conn: psycopg.Connection) -> bool:
    row = conn.execute(
        "SELECT confirmed_flush_lsn >= pg_current_wal_lsn() FROM pg_replication_slots"
    ).fetchone()
    return bool(row and row[0])


def test_a_kill_while_a_row_cannot_be_marked_loses_nothing(
    dsn: str, swapped: psycopg.Connection, collected: Collected
) -> None:
    """Killed (SIGKILL) while the duplicate is being retried: the slot was not confirmed past
    it, so the next run receives it again, goes on from the attempts counted in the database
    and dead-letters it; every other row is marked once."""
    conn = swapped
    cdc_relay(dsn, collected.factory(), until_caught_up=True).run()  # the slot, an empty backlog
    before = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    _insert(conn, (1, '{"n": 1}'), (DUPLICATE, '{"again": 13}'), (2, '{"n": 2}'))
    after = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # past the duplicate
    _insert(conn, (3, '{"n": 3}'))
    command = [sys.executable, "-m", "outbox_migrate", "relay", "--mode", "cdc", "--sink",
               "stdout", "--dsn", dsn]  # fmt: skip
    proc = subprocess.Popen(
        [*command, "--max-attempts", "100000"], cwd=REPO, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: _attempts(conn, DUPLICATE) >= 3, what="attempts counted")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    confirmed = slot_row(conn)
    assert confirmed is not None and confirmed[0] <= before, (confirmed, before)
    assert ids_in(conn, "outbox_unpublished") == [DUPLICATE]
    counted = _attempts(conn, DUPLICATE)
    time.sleep(0.5)  # the walsender of the killed run lets go of the slot
    ran = subprocess.run(
        [*command, "--until-empty", "--max-attempts", str(counted + 1)], cwd=REPO,
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    dead = _dead(conn)
    assert [(d[1], json.loads(d[4])) for d in dead] == [(DUPLICATE, {"again": 13})]
    # The count went on from the database (the careful start's count before the publish,
    # is taken back once the broker acknowledged it; the failed mark counts).
    assert dead[0][2] == counted + 1
    assert "SQLSTATE 23505" in dead[0][3]
    assert ids_in(conn, "outbox_unpublished") == []
    published = ids_in(conn, "outbox")
    assert sorted(published) == [1, 2, 3, DUPLICATE]
    confirmed = slot_row(conn)
    assert confirmed is not None and confirmed[0] >= after  # settled: the slot moved on


def test_a_mark_that_fails_for_another_reason_stops_the_relay_with_exit_1(
    dsn: str, swapped: psycopg.Connection
) -> None:
    """Not a constraint (a trigger on the published partition raises): not a bad row, a
    runtime fault — the relay stops with exit 1 (2 is for bad input found before work
    starts), the row stays unpublished and the slot unconfirmed past it."""
    conn = swapped
    conn.execute(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
        "$$BEGIN RAISE EXCEPTION 'the archive is read-only today'; END$$"
    )
    conn.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION refuse()"
    )
    _insert(conn, (1, '{"n": 1}'))
    ran = subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "relay", "--mode", "cdc", "--sink", "stdout",
         "--dsn", dsn, "--until-empty"],
        cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert ran.returncode == 1, (ran.returncode, ran.stderr)
    assert "the archive is read-only today" in ran.stderr
    assert "Traceback" not in ran.stderr
    assert ids_in(conn, "outbox_unpublished") == [1]
