"""One bad row never stops the polling relay: it goes to the dead letters with its reason after
`max_attempts`, every other row flows, and the relay keeps running (or exits 0 with
`--until-empty`).

Each kind below stopped the whole relay before (a failed claim or mark for the whole batch, a
`RelayError`, the same on every restart): a bytea payload that is not UTF-8 (django-jaiminho
stores pickles), key and event-type columns that are not text (`message_key uuid`, an int
event type), a text headers column and headers that are not a JSON object, and after the swap
a duplicate id whose move into the published partition breaks the old primary key.
"""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import MessagesRejected, RelayFailed
from outbox_migrate.relay.options import Mode, Ordering, RelayOptions
from outbox_migrate.relay.sinks import SinkConfig
from outbox_migrate.relay.sinks.stdout import StdoutSink
from outbox_migrate.relay.worker import Relay, running

from .conftest import PARTITIONED_START, SPEC, Collected, ids_in, swapped_outbox

PICKLE = pickle.dumps({"order": 7}, protocol=4)
"""A pickled payload as django-jaiminho stores it: starts with 0x80, never UTF-8."""


def _relay(dsn: str, factory: Any, spec: OutboxSpec, **options: Any) -> Relay:
    defaults: dict[str, Any] = {"until_empty": True, "listen": False, "batch_size": 7,
                                "max_attempts": 2, "poll_interval_s": 0.02}  # fmt: skip
    defaults.update(options)
    return Relay(dsn, factory, spec=spec, options=RelayOptions(**defaults))


def _stdout(stream: io.StringIO) -> Any:
    """The stdout sink with its JSON envelope, writing to `stream`: the envelope is where a
    raw payload or a key that is not a string used to fail."""
    return lambda: StdoutSink(stream=stream)


def _dead(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT id, attempts, last_error, payload, payload_bytes FROM outbox_dead_letter "
        "ORDER BY id"
    ).fetchall()


# -- a bytea payload that is not UTF-8 (django-jaiminho) -------------------------------------


def _jaiminho(conn: psycopg.Connection) -> OutboxSpec:
    """Shaped like django-jaiminho's event table: a pickled `message` (bytea), `type`,
    `sent_at` as the publication time."""
    conn.execute(
        "CREATE TABLE jaiminho_event (id bigserial PRIMARY KEY, type varchar(255), "
        "action varchar(64) NOT NULL DEFAULT '', message bytea NOT NULL, function bytea, "
        "strategy varchar(32), stream varchar(128), "
        "created_at timestamptz NOT NULL DEFAULT now(), sent_at timestamptz)"
    )
    conn.execute(
        "INSERT INTO jaiminho_event (type, message) SELECT 'OrderCreated', "
        "convert_to('{\"n\": ' || i || '}', 'UTF8') FROM generate_series(1, 20) i"
    )
    conn.execute("UPDATE jaiminho_event SET message = %s WHERE id = 9", (PICKLE,))
    conn.commit()
    return OutboxSpec(
        table="jaiminho_event",
        payload_column="message",
        published_column="sent_at",
        event_type_column="type",
    )


def test_a_pickled_bytea_payload_is_sent_as_bytes(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    """A sink that sends a body gets the pickle byte for byte; the batch around it flows."""
    spec = _jaiminho(conn)
    _relay(dsn, collected.factory(), spec, mode=Mode.flat).run()
    assert sorted(collected.ids) == list(range(1, 21))
    by_id = {m.id: m for m in collected.messages}
    assert by_id[9].payload == PICKLE and by_id[9].payload_bytes == PICKLE
    assert by_id[8].payload == '{"n": 8}'  # UTF-8 bodies stay text
    assert conn.execute("SELECT count(*) FROM jaiminho_event WHERE sent_at IS NULL").fetchone() == (
        0,
    )


def test_a_pickled_payload_in_a_json_envelope_is_dead_lettered_with_its_bytes(
    dsn: str, conn: psycopg.Connection
) -> None:
    """The JSON envelope cannot carry raw bytes: that message alone is dead-lettered (its
    bytes kept), the 19 others are written."""
    spec = _jaiminho(conn)
    stream = io.StringIO()
    relay = _relay(dsn, _stdout(stream), spec, mode=Mode.flat)
    relay.run()
    written = [json.loads(line)["id"] for line in stream.getvalue().splitlines()]
    assert sorted(set(written)) == [i for i in range(1, 21) if i != 9]
    dead = _dead(conn)
    assert [(d[0], d[1]) for d in dead] == [(9, 2)]
    assert "UTF-8" in dead[0][2]  # the sink's reason
    assert bytes(dead[0][4]) == PICKLE and dead[0][3] == "\\x" + PICKLE.hex()
    assert relay.stats.dead_lettered == 1
    assert conn.execute("SELECT count(*) FROM jaiminho_event WHERE sent_at IS NULL").fetchone() == (
        0,
    )


def test_an_existing_dead_letter_table_keeps_working_for_raw_payloads(
    dsn: str, conn: psycopg.Connection
) -> None:
    """A dead-letter table created by an earlier version (payload text NOT NULL, no bytes
    column) is given the `payload_bytes` column when the relay's role owns it."""
    conn.execute(
        "CREATE TABLE outbox_dead_letter (source_table text NOT NULL, id int8 NOT NULL, "
        "event_type text, message_key text, payload text NOT NULL, created_at timestamptz NOT "
        "NULL, attempts int NOT NULL, last_error text NOT NULL, dead_at timestamptz NOT NULL "
        "DEFAULT now(), PRIMARY KEY (source_table, id))"
    )
    spec = _jaiminho(conn)
    _relay(dsn, _stdout(io.StringIO()), spec, mode=Mode.flat).run()
    dead = _dead(conn)
    assert [d[0] for d in dead] == [9] and bytes(dead[0][4]) == PICKLE


# -- key and event-type columns that are not text ------------------------------------------


def test_uuid_keys_and_integer_event_types_are_sent_as_text(
    dsn: str, conn: psycopg.Connection
) -> None:
    """`message_key uuid` is picked up by default; it and an int event type used to fail
    every batch ("first argument must be a string, not UUID")."""
    conn.execute(
        "CREATE TABLE outbox (id bigserial PRIMARY KEY, event_type int NOT NULL, "
        "message_key uuid, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT "
        "now(), published_at timestamptz)"
    )
    keys = [uuid.uuid4() for _ in range(10)]
    for i, key in enumerate(keys):
        conn.execute(
            "INSERT INTO outbox (event_type, message_key, payload) VALUES (%s, %s, %s)",
            (i, key, json.dumps({"n": i})),
        )
    conn.commit()
    stream = io.StringIO()
    _relay(dsn, _stdout(stream), OutboxSpec(table="outbox"), mode=Mode.flat).run()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [o["key"] for o in lines] == [str(k) for k in keys]
    assert [o["event_type"] for o in lines] == [str(i) for i in range(10)]
    assert ids_in(conn, "outbox", published=False) == []


def test_key_ordering_shards_on_a_uuid_key(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    conn.execute(
        "CREATE TABLE outbox (id bigserial PRIMARY KEY, event_type text, message_key uuid, "
        "payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), "
        "published_at timestamptz)"
    )
    conn.execute(
        "INSERT INTO outbox (message_key, payload) SELECT gen_random_uuid(), '{}' "
        "FROM generate_series(1, 30)"
    )
    conn.commit()
    _relay(dsn, collected.factory(), OutboxSpec(table="outbox"), mode=Mode.flat,
           ordering=Ordering.key, workers=2).run()  # fmt: skip
    assert sorted(collected.ids) == list(range(1, 31))
    assert all(isinstance(m.key, str) for m in collected.messages)


# -- headers that are not a JSON object ------------------------------------------------------


def test_text_headers_are_parsed_per_row_and_a_non_object_is_a_bad_row(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    """A text headers column is accepted; a value that is not a JSON object (invalid JSON, an
    array) is that row's problem: dead-lettered with the reason, the others published with
    their headers."""
    conn.execute(
        "CREATE TABLE outbox (id bigserial PRIMARY KEY, payload jsonb NOT NULL, headers text, "
        "created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz)"
    )
    conn.execute(
        "INSERT INTO outbox (payload, headers) SELECT jsonb_build_object('n', i), "
        "CASE i WHEN 4 THEN 'not json {' WHEN 11 THEN '[1, 2]' WHEN 12 THEN NULL "
        "ELSE json_build_object('traceparent', 'tp-' || i, 'v', i)::text END "
        "FROM generate_series(1, 15) i"
    )
    conn.commit()
    relay = _relay(dsn, collected.factory(), OutboxSpec(table="outbox"), mode=Mode.flat)
    relay.run()
    assert sorted(collected.ids) == [i for i in range(1, 16) if i not in (4, 11)]
    by_id = {m.id: m for m in collected.messages}
    assert by_id[5].headers()["traceparent"] == "tp-5" and by_id[5].headers()["v"] == "5"
    assert by_id[12].extra_headers == ()  # NULL: no headers, not a bad row
    dead = _dead(conn)
    assert [(d[0], d[1]) for d in dead] == [(4, 2), (11, 2)]
    assert all("not hold a JSON object" in d[2] for d in dead)
    assert ids_in(conn, "outbox", published=False) == []
    assert relay.stats.bad_rows == 4  # two rows, two attempts each


def test_jsonb_headers_that_are_not_an_object_are_a_bad_row(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """On the partitioned outbox too: a jsonb array or string in the headers column was
    silently sent without headers; now it is dead-lettered and its batch flows."""
    partitioned.execute("ALTER TABLE outbox_new ADD COLUMN headers jsonb")
    insert_rows(partitioned, "outbox_new", 20, spec=SPEC)
    bad = PARTITIONED_START + 6
    partitioned.execute('UPDATE outbox_new SET headers = \'{"a": "b"}\'')
    partitioned.execute("UPDATE outbox_new SET headers = '\"oops\"' WHERE id = %s", (bad,))
    _relay(dsn, collected.factory(), SPEC).run()
    assert sorted(collected.ids) == [
        i for i in range(PARTITIONED_START, PARTITIONED_START + 20) if i != bad
    ]
    assert all(m.headers()["a"] == "b" for m in collected.messages)
    assert [(d[0], d[1]) for d in _dead(partitioned)] == [(bad, 2)]
    assert ids_in(partitioned, "outbox_unpublished") == []


def test_with_key_ordering_a_bad_row_parks_only_its_key(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    """Key A's bad row parks key A: A's later messages are not marked before it is
    dead-lettered (each is delivered last after it); keys B and C flow meanwhile."""
    conn.execute(
        "CREATE TABLE outbox (id bigserial PRIMARY KEY, message_key text NOT NULL, "
        "payload jsonb NOT NULL, headers text, created_at timestamptz NOT NULL DEFAULT now(), "
        "published_at timestamptz)"
    )
    conn.execute(
        "INSERT INTO outbox (message_key, payload, headers) SELECT "
        "(ARRAY['A', 'B', 'C'])[1 + i % 3], jsonb_build_object('n', i), "
        "CASE WHEN i = 4 THEN 'oops' ELSE '{}' END FROM generate_series(1, 30) i"
    )
    conn.commit()
    bad_key = conn.execute("SELECT message_key FROM outbox WHERE id = 4").fetchone()[0]
    relay = _relay(dsn, collected.factory(), OutboxSpec(table="outbox"), mode=Mode.flat,
                   ordering=Ordering.key, batch_size=10)  # fmt: skip
    relay.run()
    assert [(d[0], d[1]) for d in _dead(conn)] == [(4, 2)]
    assert ids_in(conn, "outbox", published=False) == []
    assert sorted(set(collected.ids)) == [i for i in range(1, 31) if i != 4]
    others = [m.id for m in collected.messages if m.key != bad_key]
    held = [m.id for m in collected.messages if m.key == bad_key and m.id > 4]
    # Other keys were delivered once each, in id order: nothing of theirs waited or was sent
    # again. The bad key's later messages were held until the bad row was dead-lettered.
    assert len(others) == len(set(others)) and others == sorted(others)
    assert len(held) > len(set(held))
    assert relay.stats.bad_rows == 2


# -- a duplicate id after the swap ------------------------------------------------------------


def _swapped_with_duplicate(conn: psycopg.Connection) -> int:
    """The application inserts an id that is already published (the old key would have
    refused it)."""
    swapped_outbox(conn, [13], 30)
    return 13


SWAPPED = SPEC


def test_a_duplicate_id_after_the_swap_is_dead_lettered_not_a_crash_loop(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    duplicate = _swapped_with_duplicate(conn)
    relay = _relay(dsn, collected.factory(), SWAPPED, batch_size=10)
    relay.run()
    assert ids_in(conn, "outbox_unpublished") == []
    published = ids_in(conn, "outbox")
    assert published.count(duplicate) == 1  # the original; the duplicate was never moved
    assert sorted(set(published)) == list(range(1, 31))
    dead = _dead(conn)
    assert [(d[0], d[1]) for d in dead] == [(duplicate, 2)]
    assert "23505" in dead[0][2] and "outbox_pkey" in dead[0][2]
    assert json.loads(dead[0][3]) == {"n": duplicate}
    assert relay.stats.dead_lettered == 1


def test_two_unpublished_rows_with_one_id_the_first_is_marked_the_second_dead_lettered(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    """Both copies in one batch, none published yet: the batch's mark moves the first and
    fails on the second; the repair marks the first (claim order) and dead-letters the
    second, removed from the outbox."""
    _swapped_with_duplicate(conn)
    conn.execute("INSERT INTO outbox_new (id, payload) VALUES (20, '{\"copy\": 2}')")
    conn.commit()
    _relay(dsn, collected.factory(), SWAPPED, batch_size=50).run()
    assert ids_in(conn, "outbox_unpublished") == []
    assert ids_in(conn, "outbox").count(20) == 1
    assert conn.execute("SELECT payload FROM outbox WHERE id = 20").fetchone() == ({"n": 20},)
    dead = _dead(conn)
    assert sorted((d[0], json.loads(d[3]).get("copy")) for d in dead) == [(13, None), (20, 2)]


def test_with_key_ordering_a_duplicate_id_parks_only_its_key(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    """The repair leaves the rows after the bad one of its key unmarked (they go out again
    after it) and parks the key; the other keys are delivered once, in order."""
    duplicate = _swapped_with_duplicate(conn)
    conn.execute(
        "UPDATE outbox_new SET message_key = (ARRAY['A', 'B', 'C'])[1 + id % 3] "
        "WHERE published_at IS NULL"
    )
    conn.commit()
    bad_key = "ABC"[duplicate % 3]
    relay = _relay(dsn, collected.factory(), SWAPPED, ordering=Ordering.key, batch_size=10)
    relay.run()
    assert [(d[0], d[1]) for d in _dead(conn)] == [(duplicate, 2)]
    assert ids_in(conn, "outbox_unpublished") == []
    others = [m.id for m in collected.messages if m.key != bad_key]
    held = [m.id for m in collected.messages if m.key == bad_key and m.id > duplicate]
    assert len(others) == len(set(others)) == 20 and others == sorted(others)
    assert len(held) > len(set(held))  # sent in the failed batch, then again after it
    assert sorted(set(held)) == [i for i in range(duplicate + 3, 31, 3)]


def test_attempts_of_a_bad_row_survive_a_restart(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    """The attempts of a row whose mark fails are counted in the database in the repair's
    transaction: a restarted relay goes on from the count, it does not start again."""
    duplicate = _swapped_with_duplicate(conn)

    def attempts() -> int:
        try:
            row = conn.execute(
                "SELECT attempts FROM outbox_dead_letter_attempts WHERE id = %s", (duplicate,)
            ).fetchone()
        except psycopg.errors.UndefinedTable:
            conn.rollback()
            return 0
        conn.rollback()
        return int(row[0]) if row else 0

    first = _relay(dsn, collected.factory(), SWAPPED, until_empty=False, max_attempts=1000,
                   batch_size=10)  # fmt: skip
    with running(first):
        deadline = time.monotonic() + 30
        while attempts() < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
    counted = attempts()
    assert counted >= 2 and not _dead(conn)
    second = _relay(dsn, collected.factory(), SWAPPED, max_attempts=counted + 1, batch_size=10)
    second.run()
    dead = _dead(conn)
    assert [(d[0], d[1]) for d in dead] == [(duplicate, counted + 1)]
    assert second.stats.bad_rows == 1  # one attempt more, not max_attempts more
    assert ids_in(conn, "outbox_unpublished") == []


@pytest.mark.parametrize("mode", [Mode.flat, Mode.partitioned])
def test_a_row_whose_mark_a_check_refuses_is_dead_lettered(
    dsn: str, conn: psycopg.Connection, collected: Collected, mode: Mode
) -> None:
    """Any constraint the mark breaks (here a CHECK on the published rows) is the row's."""
    if mode is Mode.flat:
        conn.execute(
            "CREATE TABLE outbox (id bigserial PRIMARY KEY, payload jsonb NOT NULL, "
            "created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz, "
            "CONSTRAINT no_publishing_7 CHECK (published_at IS NULL OR id <> 7))"
        )
        spec, table = OutboxSpec(table="outbox"), "outbox"
    else:
        conn.execute(
            "CREATE TABLE outbox_new (id bigserial, payload jsonb NOT NULL, created_at "
            "timestamptz NOT NULL DEFAULT now(), published_at timestamptz) "
            "PARTITION BY LIST (published_at)"
        )
        conn.execute("CREATE TABLE outbox_unpublished PARTITION OF outbox_new FOR VALUES IN (NULL)")
        conn.execute(
            "CREATE TABLE outbox_published PARTITION OF outbox_new "
            "(CONSTRAINT no_publishing_7 CHECK (id <> 7)) DEFAULT"
        )
        spec, table = OutboxSpec(), "outbox_new"
    conn.execute(f"INSERT INTO {table} (payload) SELECT '{{}}' FROM generate_series(1, 25)")
    conn.commit()
    _relay(dsn, collected.factory(), spec, mode=mode, batch_size=10).run()
    dead = _dead(conn)
    assert [(d[0], d[1]) for d in dead] == [(7, 2)]
    assert "23514" in dead[0][2] and "no_publishing_7" in dead[0][2]
    remaining = conn.execute(f"SELECT count(*) FROM {table} WHERE published_at IS NULL")
    assert remaining.fetchone() == (0,)
    assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (24,)


# -- exit codes -------------------------------------------------------------------------------


def test_a_relay_that_stops_on_a_runtime_fault_exits_1(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    """A fault met while running (here a trigger that refuses every mark, not a constraint a
    row breaks) is a failure, exit 1 — not "bad input" (2), which is refused before work."""
    partitioned.execute(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
        "$$BEGIN RAISE EXCEPTION 'marks are frozen'; END$$"
    )
    partitioned.execute(
        "CREATE TRIGGER refuse BEFORE UPDATE ON outbox_unpublished "
        "FOR EACH ROW EXECUTE FUNCTION refuse()"
    )
    insert_rows(partitioned, "outbox_new", 3, spec=SPEC)
    partitioned.commit()
    result = subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "relay", "--sink", "stdout", "--until-empty",
         "--no-listen", "--dsn", dsn],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("outbox-migrate: error: relay worker failed: marks are frozen"), last
    assert "Traceback" not in result.stderr
    assert len(ids_in(partitioned, "outbox_unpublished")) == 3  # nothing lost


def test_two_unpublished_copies_of_a_published_id_in_one_batch_are_both_kept(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    """Both copies of id 13 fail their mark (13 is already published). Before, the repair
    dead-lettered one message under (source, 13) and deleted both rows: the other copy was
    lost. Now each copy ends in the dead-letter table with its own payload (the second under
    a copy label), nothing stays unpublished, and the relay ran to the end."""
    duplicate = _swapped_with_duplicate(conn)
    conn.execute("INSERT INTO outbox_new (id, payload) VALUES (%s, '{\"copy\": 2}')", (duplicate,))
    conn.commit()
    relay = _relay(dsn, collected.factory(), SWAPPED, batch_size=50)
    relay.run()
    assert ids_in(conn, "outbox_unpublished") == []
    assert ids_in(conn, "outbox").count(duplicate) == 1  # the published original
    dead = conn.execute(
        "SELECT source_table, id, payload FROM outbox_dead_letter ORDER BY source_table"
    ).fetchall()
    assert sorted(json.loads(d[2]).get("copy", 1) for d in dead) == [1, 2], dead
    assert {d[1] for d in dead} == {duplicate}
    assert len({d[0] for d in dead}) == 2, dead  # the second copy has its own label
    assert relay.stats.dead_lettered == 2


def test_two_copies_the_sink_refuses_in_one_batch_are_counted_once_and_both_kept(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """Two unpublished rows with one id, both refused by the sink in one batch: counting
    their attempts sent the id twice to one upsert (SQLSTATE 21000: "ON CONFLICT DO UPDATE
    command cannot affect row a second time") and the relay stopped. Now the id counts one
    attempt per try and both copies reach the dead-letter table."""
    insert_rows(partitioned, "outbox_new", 5, spec=SPEC)
    twin = PARTITIONED_START + 2
    partitioned.execute(
        "INSERT INTO outbox_new (id, payload) OVERRIDING SYSTEM VALUE VALUES (%s, '{\"copy\": 2}')",
        (twin,),
    )
    partitioned.commit()

    def refuse(batch: list[Any]) -> None:
        if any(m.id == twin for m in batch):
            collected.add([m for m in batch if m.id != twin])
            raise MessagesRejected("collect", {twin: "refused (test)"})

    relay = _relay(dsn, collected.factory(refuse), SPEC, max_attempts=2, backoff_base_s=0.01,
                   backoff_cap_s=0.02)  # fmt: skip
    relay.run()
    dead = partitioned.execute(
        "SELECT id, attempts, payload FROM outbox_dead_letter ORDER BY source_table"
    ).fetchall()
    assert [(d[0], d[1]) for d in dead] == [(twin, 2), (twin, 2)], dead
    assert sorted(json.loads(d[2]).get("copy", 1) for d in dead) == [1, 2]
    assert ids_in(partitioned, "outbox_unpublished") == []
    assert twin not in collected.ids


# -- a sink that raises outside its protocol ---------------------------------------------------


def test_a_message_that_crashes_the_sink_is_dead_lettered_after_max_attempts(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """The sink raises something unexpected on one row of five: the relay stopped, and
    stopped again on every restart, for ever (the attempt was never counted). Now, as in CDC
    mode, the crash counts against the batch the sink held, a row with a failure on record is
    published alone (the next crash counts against it only), and at max_attempts it is
    dead-lettered without being published again; the relay still stops on each crash."""
    from outbox_migrate.errors import RelayFailed

    insert_rows(partitioned, "outbox_new", 5, spec=SPEC)
    ids = ids_in(partitioned, "outbox_new")
    poison = ids[2]

    def crash(batch: list[Any]) -> None:
        if any(m.id == poison for m in batch):
            raise RuntimeError("serializer blew up")

    crashes = 0
    for _ in range(5):
        try:
            _relay(dsn, collected.factory(crash), SPEC, max_attempts=2).run()
            break
        except RelayFailed as exc:
            assert "serializer blew up" in str(exc)
            crashes += 1
    assert crashes == 2
    dead = partitioned.execute("SELECT id, attempts, last_error FROM outbox_dead_letter").fetchall()
    assert dead == [(poison, 2, "RuntimeError: serializer blew up")]
    assert partitioned.execute("SELECT count(*) FROM outbox_dead_letter_attempts").fetchone() == (
        0,
    )
    assert ids_in(partitioned, "outbox_unpublished") == []
    assert sorted(set(collected.ids)) == [i for i in ids if i != poison]


def test_a_failed_mark_costs_its_batch_not_the_run(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    """A draining relay reads ahead (a second session claims the next batch while one is
    published). A mark that breaks the primary key rolls back its own batch only: it is
    repaired on the other session and the run goes on — every batch after the bad ones
    still comes from the read-ahead, none is claimed twice. Bad rows in two batches in a row
    (one per session) are both repaired. Ending the run instead rolled back the batch
    claimed ahead and claimed it again without overlap (bench/bad_rows.py)."""
    bad = [15, 25, 75]  # batches 2 and 3 (one per session), and batch 8
    swapped_outbox(conn, bad, 200)
    relay = _relay(dsn, collected.factory(), SWAPPED, batch_size=10, max_attempts=3)
    relay.run()
    assert ids_in(conn, "outbox_unpublished") == []
    assert sorted(d[0] for d in _dead(conn)) == bad
    good = [m.id for m in collected.messages if m.id not in bad]
    assert sorted(good) == [i for i in range(1, 201) if i not in bad]
    assert len(good) == len(set(good))  # no batch was published twice
    # 20 batches and the empty claim after them: only the first is claimed on the lease
    # session, all the others ahead (ending the run at a failed mark: 18).
    assert relay.stats.read_ahead == 20, relay.stats.as_dict()
    assert relay.stats.published == 197 and relay.stats.bad_rows == 9


# -- a table with nowhere to put a published row is the table's fault, not the rows' -------


def _unpublished_partition_only(conn: psycopg.Connection) -> None:
    """COPRA's V2 layout: the partitioned table's published rows go to the old table once it
    is attached as DEFAULT (before V4); until then it has the unpublished partition alone."""
    conn.execute(
        "CREATE TABLE outbox_new (id bigserial, payload jsonb NOT NULL, created_at "
        "timestamptz NOT NULL DEFAULT now(), published_at timestamptz) "
        "PARTITION BY LIST (published_at)"
    )
    conn.execute("CREATE TABLE outbox_unpublished PARTITION OF outbox_new FOR VALUES IN (NULL)")
    conn.execute("INSERT INTO outbox_new (payload) SELECT '{}' FROM generate_series(1, 14)")
    conn.commit()


def test_the_relay_refuses_a_partitioned_table_without_a_partition_for_published_rows(
    dsn: str, conn: psycopg.Connection
) -> None:
    """The relay in its default mode during COPRA's V2 sent each message once per try, then
    dead-lettered all 14 and deleted them from the outbox, exit 0."""
    _unpublished_partition_only(conn)
    result = subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "relay", "--sink", "stdout", "--until-empty",
         "--no-listen", "--dsn", dsn],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""  # nothing sent
    (line,) = result.stderr.strip().splitlines()
    assert "has no partition for published rows" in line and "--mode flat" in line
    assert len(ids_in(conn, "outbox_unpublished")) == 14


def test_a_published_partition_detached_while_the_relay_runs_stops_it_and_keeps_the_rows(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    """The same fault met mid-run (the DEFAULT partition detached under a running relay):
    every row failed alone, so all were dead-lettered. Now the relay stops with exit 1's
    error and the rows stay in the outbox, unpublished."""
    _unpublished_partition_only(conn)
    conn.execute("CREATE TABLE outbox_published PARTITION OF outbox_new DEFAULT")
    conn.commit()
    sent_once = threading.Event()

    def detach_after_the_first_batch(_batch: Any) -> None:
        if not sent_once.is_set():
            sent_once.set()
            with psycopg.connect(dsn, autocommit=True) as other:
                other.execute("ALTER TABLE outbox_new DETACH PARTITION outbox_published")

    relay = _relay(dsn, collected.factory(detach_after_the_first_batch), SPEC, batch_size=5)
    with pytest.raises(RelayFailed, match="has no partition for published rows"):
        relay.run()
    assert conn.execute("SELECT count(*) FROM outbox_dead_letter").fetchone() == (0,)
    assert len(ids_in(conn, "outbox_unpublished")) == 14


# -- a text payload that is not JSON, in an envelope that embeds JSON ------------------------


@pytest.mark.parametrize("envelope", ["json", "cloudevents", "raw"])
def test_a_text_payload_that_is_not_json_is_dead_lettered_by_a_json_envelope(
    dsn: str, conn: psycopg.Connection, envelope: str
) -> None:
    """A text payload column holds any text. Embedded verbatim in the JSON envelope (stdout's
    and HTTP's default) or CloudEvents' `data`, `hello "world` made a line no consumer could
    parse, and it was acknowledged and marked. Now that row is dead-lettered with the reason,
    the JSON ones flow, every line parses; `raw` sends every payload as it is."""
    conn.execute(
        "CREATE TABLE outbox (id bigserial PRIMARY KEY, payload text NOT NULL, "
        "created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz)"
    )
    payloads = ['{"n": 1}', 'hello "world', '"a JSON string"', "", "[1, 2]"]
    for payload in payloads:
        conn.execute("INSERT INTO outbox (payload) VALUES (%s)", (payload,))
    conn.commit()
    stream = io.StringIO()
    sink = lambda: StdoutSink(SinkConfig(extra={"envelope": envelope}), stream=stream)  # noqa: E731
    _relay(dsn, sink, OutboxSpec(table="outbox"), mode=Mode.flat).run()
    lines = stream.getvalue().splitlines()
    if envelope == "raw":
        assert sorted(lines) == sorted(payloads) and _dead(conn) == []
        return
    documents = [json.loads(line) for line in lines]  # every line is JSON
    body = "payload" if envelope == "json" else "data"
    assert sorted(json.dumps(d[body]) for d in documents) == sorted(
        json.dumps(json.loads(p)) for p in ('{"n": 1}', '"a JSON string"', "[1, 2]")
    )
    dead = _dead(conn)
    assert [d[0] for d in dead] == [2, 4]
    assert all("not JSON" in d[2] and "envelope=raw" in d[2] for d in dead)
    assert conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL").fetchone() == (0,)
