"""Claim → publish → mark on real PostgreSQL: every mode, batching, workers, failures."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Sequence

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Mode, Ordering, RelayOptions
from outbox_migrate.relay.worker import Relay, running

from .conftest import SPEC, Collected, ids_in


def run_until_empty(dsn: str, collected: Collected, fail=None, **options) -> Relay:
    relay = Relay(
        dsn,
        collected.factory(fail),
        spec=SPEC,
        options=RelayOptions(until_empty=True, listen=False, poll_interval_s=0.05, **options),
    )
    relay.run()
    return relay


def test_partitioned_publishes_every_row_once_in_id_order(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(partitioned, "outbox_new", 1234, spec=SPEC)
    relay = run_until_empty(dsn, collected, mode=Mode.partitioned, batch_size=100)
    expected = ids_in(partitioned, "outbox_new")
    assert collected.ids == expected  # one worker: exactly id order
    assert ids_in(partitioned, "outbox_unpublished") == []
    assert ids_in(partitioned, "outbox_published") == expected
    assert relay.stats.published == 1234
    assert relay.stats.batches == 13
    first = collected.messages[0]
    assert first.table == "public.outbox"  # the outbox's name, not the partitioned table's
    assert first.event_type == "event" and first.key and first.key.startswith("k-")
    assert '"n"' in first.payload


@pytest.mark.parametrize("freeze", [False, True])
def test_freeze_gc_only_where_the_process_is_the_relays(
    dsn: str, partitioned: psycopg.Connection, collected: Collected, freeze: bool
) -> None:
    """The CLI's relay takes its start-up objects out of the collector's reach; a relay
    embedded in someone's process (the default) leaves that process's collector alone."""
    gc.unfreeze()
    insert_rows(partitioned, "outbox_new", 20, spec=SPEC)
    options = RelayOptions(until_empty=True, listen=False, poll_interval_s=0.05,
                           mode=Mode.partitioned)  # fmt: skip
    relay = Relay(dsn, collected.factory(None), spec=SPEC, options=options, freeze_gc=freeze)
    try:
        relay.run()
        assert (gc.get_freeze_count() > 0) is freeze
    finally:
        gc.unfreeze()
    assert collected.ids == ids_in(partitioned, "outbox_new")


def test_flat_mode_marks_rows_in_place(
    dsn: str, flat: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(flat, "outbox", 300, spec=SPEC)
    insert_rows(flat, "outbox", 50, spec=SPEC, published=True)
    relay = run_until_empty(dsn, collected, mode=Mode.flat, batch_size=64)
    assert sorted(collected.ids) == list(range(1, 301))
    assert ids_in(flat, "outbox", published=False) == []
    assert relay.stats.published == 300


def test_missing_table_is_a_relay_error(dsn: str, collected: Collected) -> None:
    with pytest.raises(RelayError, match="does not exist"):
        run_until_empty(dsn, collected, mode=Mode.partitioned)


def test_explicit_key_column_must_exist(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    with pytest.raises(RelayError, match="no column 'tenant'"):
        run_until_empty(dsn, collected, key_column="tenant")


def test_key_ordering_needs_a_key_column(dsn: str, conn: psycopg.Connection, collected) -> None:
    conn.execute(
        "CREATE TABLE outbox_new (id int8 GENERATED ALWAYS AS IDENTITY, payload json NOT NULL, "
        "created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz) "
        "PARTITION BY LIST (published_at)"
    )
    with pytest.raises(RelayError, match="--ordering key needs a key column"):
        run_until_empty(dsn, collected, ordering=Ordering.key)


def test_tables_without_optional_columns_publish_with_nulls(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    # The spec's own DDL: no event_type, no message_key.
    conn.execute(
        "CREATE TABLE outbox_new (id int8 GENERATED ALWAYS AS IDENTITY, payload json NOT NULL, "
        "created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz) "
        "PARTITION BY LIST (published_at)"
    )
    conn.execute("CREATE TABLE outbox_unpublished PARTITION OF outbox_new FOR VALUES IN (NULL)")
    conn.execute("CREATE TABLE outbox_published PARTITION OF outbox_new DEFAULT")
    conn.execute("INSERT INTO outbox_new (payload) SELECT '{}' FROM generate_series(1, 10)")
    run_until_empty(dsn, collected)
    assert sorted(collected.ids) == list(range(1, 11))
    assert all(m.key is None and m.event_type is None for m in collected.messages)


@pytest.mark.slow
def test_four_workers_do_not_collide(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """The sharded claim: ≤ 1 % of batches retried on SQLSTATE 40001 (issue's goal)."""
    insert_rows(partitioned, "outbox_new", 20_000, spec=SPEC)
    relay = run_until_empty(dsn, collected, workers=4, batch_size=100)
    assert sorted(collected.ids) == ids_in(partitioned, "outbox_new")
    assert collected.duplicates() == 0
    assert relay.stats.batches >= 200
    assert relay.stats.serialization_retries <= relay.stats.batches // 100


def test_claimers_outside_the_shard_scheme_collide_safely(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """A claimer that knows nothing of our shards (plain SKIP LOCKED claim+mark, as a V3 app
    instance might run) races the relay: 40001 may hit either side and is retried; every row
    is published by exactly one of them."""
    insert_rows(partitioned, "outbox_new", 20_000, spec=SPEC)
    other_ids: list[int] = []
    other_retries = {"n": 0}
    done = threading.Event()

    def plain_claimer() -> None:
        with psycopg.connect(dsn, autocommit=True) as other:
            while not done.is_set():
                try:
                    rows = other.execute(
                        "WITH b AS (SELECT id FROM outbox_unpublished ORDER BY id LIMIT 50 "
                        "FOR UPDATE SKIP LOCKED) UPDATE outbox_new o SET published_at = now() "
                        "FROM b WHERE o.published_at IS NULL AND o.id = b.id RETURNING o.id"
                    ).fetchall()
                except psycopg.errors.SerializationFailure:
                    other_retries["n"] += 1
                    continue
                if not rows:
                    return
                other_ids.extend(r[0] for r in rows)

    thread = threading.Thread(target=plain_claimer)
    thread.start()
    try:
        relay = run_until_empty(dsn, collected, workers=2, batch_size=50)
    finally:
        thread.join(60)
        done.set()
    assert not set(other_ids) & set(collected.ids)
    assert sorted(other_ids + collected.ids) == ids_in(partitioned, "outbox_new")
    assert collected.duplicates() == 0
    assert relay.stats.published == len(collected.ids)


def test_two_relay_processes_share_the_shards(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """Two relays (as two processes would: own sessions, no shared memory), one worker each,
    `shards=2`: the second one gets a fair share within a few rebalances; none is lost or
    published twice; a relay that stops hands its shards to the other."""
    from outbox_migrate.relay.shards import REBALANCE_S

    options = RelayOptions(shards=2, batch_size=20, listen=False, poll_interval_s=0.02)
    first = Relay(dsn, collected.factory(), spec=SPEC, options=options)
    second_seen = Collected()
    second = Relay(dsn, second_seen.factory(), spec=SPEC, options=options)
    with running(first):
        time.sleep(2 * REBALANCE_S)
        with running(second):
            time.sleep(4 * REBALANCE_S)  # fair shares settle
            insert_rows(partitioned, "outbox_new", 400, spec=SPEC)
            deadline = time.monotonic() + 30
            while ids_in(partitioned, "outbox_unpublished") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert second_seen.ids, "the second relay never got a shard"
            assert collected.ids, "the first relay kept no shard"
        # The second relay stopped: the first takes its shard back.
        insert_rows(partitioned, "outbox_new", 100, spec=SPEC)
        deadline = time.monotonic() + 30
        while ids_in(partitioned, "outbox_unpublished") and time.monotonic() < deadline:
            time.sleep(0.05)
    everything = collected.ids + second_seen.ids
    assert sorted(everything) == ids_in(partitioned, "outbox_new")
    assert len(set(everything)) == len(everything)
    assert {i % 2 for i in second_seen.ids} == {i % 2 for i in second_seen.ids[:1]}  # one shard


def test_sink_unavailable_rolls_back_and_retries(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(partitioned, "outbox_new", 30, spec=SPEC)
    calls = {"n": 0}
    seen_unpublished: list[int] = []

    def flaky(batch: Sequence[Message]) -> None:
        calls["n"] += 1
        if calls["n"] <= 3:
            with psycopg.connect(dsn, autocommit=True) as other:
                seen_unpublished.append(len(ids_in(other, "outbox_unpublished")))
            raise SinkUnavailable("collect", "broker down")

    relay = run_until_empty(dsn, collected, fail=flaky, backoff_base_s=0.01, backoff_cap_s=0.05)
    assert seen_unpublished == [30, 30, 30]  # never marked while the broker was down
    assert relay.stats.sink_failures == 3
    assert sorted(collected.ids) == ids_in(partitioned, "outbox_new")
    assert ids_in(partitioned, "outbox_unpublished") == []


def test_rejected_message_goes_to_dead_letter_after_max_attempts(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(partitioned, "outbox_new", 20, spec=SPEC)
    poison = 1_000_005
    attempts = {"n": 0}

    def reject(batch: Sequence[Message]) -> None:
        if any(m.id == poison for m in batch):
            attempts["n"] += 1
            collected.add([m for m in batch if m.id != poison])
            raise MessagesRejected("collect", {poison: "schema violation"})

    relay = run_until_empty(dsn, collected, fail=reject, max_attempts=3, batch_size=8)
    assert attempts["n"] == 3
    assert relay.stats.dead_lettered == 1
    assert poison not in collected.ids
    assert sorted(set(collected.ids)) == [
        i for i in ids_in(partitioned, "outbox_new") if i != poison
    ]
    assert ids_in(partitioned, "outbox_unpublished") == []
    row = partitioned.execute(
        "SELECT source_table, attempts, last_error, payload::text FROM outbox_dead_letter WHERE id = %s",
        (poison,),
    ).fetchone()
    assert row is not None and row[:3] == ("public.outbox_new", 3, "schema violation")
    assert '"n"' in row[3]


def test_a_payload_that_is_not_json_reaches_the_dead_letter_table_as_it_was(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """The dead-letter table took payloads as json: a text (or bytea) outbox whose payload is
    not JSON could not dead-letter a poison message — the insert failed and the batch with
    it, for ever. Payloads are kept as text now, byte for byte."""
    partitioned.execute("ALTER TABLE outbox_new ALTER COLUMN payload TYPE text")
    insert_rows(partitioned, "outbox_new", 10, spec=SPEC)
    poison = 1_000_004
    body = "plain text, not JSON: {unbalanced ✓"
    partitioned.execute("UPDATE outbox_new SET payload = %s WHERE id = %s", (body, poison))

    def reject(batch: Sequence[Message]) -> None:
        if any(m.id == poison for m in batch):
            collected.add([m for m in batch if m.id != poison])
            raise MessagesRejected("collect", {poison: "not JSON"})

    relay = run_until_empty(dsn, collected, fail=reject, max_attempts=2, batch_size=4)
    assert relay.stats.dead_lettered == 1
    assert ids_in(partitioned, "outbox_unpublished") == []
    row = partitioned.execute(
        "SELECT payload FROM outbox_dead_letter WHERE id = %s", (poison,)
    ).fetchone()
    assert row == (body,)


def test_rejection_counts_survive_a_restart(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    """Attempts are counted in a table, in the batch's transaction: a relay that restarts
    (crash loop, deploy) does not give a poison message its attempts back; a message
    rejected once and then accepted leaves no counter behind."""
    insert_rows(partitioned, "outbox_new", 20, spec=SPEC)
    poison, flaky = 1_000_005, 1_000_012
    seen = {"poison": 0, "flaky": 0}

    def reject(batch: Sequence[Message]) -> None:
        refused = {}
        if any(m.id == poison for m in batch):
            seen["poison"] += 1
            refused[poison] = "schema violation"
        if any(m.id == flaky for m in batch):
            seen["flaky"] += 1
            if seen["flaky"] == 1:
                refused[flaky] = "try again"
        if refused:
            collected.add([m for m in batch if m.id not in refused])
            raise MessagesRejected("collect", refused)

    def attempts_of(message_id: int) -> int:
        try:
            row = partitioned.execute(
                "SELECT attempts FROM outbox_dead_letter_attempts WHERE id = %s", (message_id,)
            ).fetchone()
        except psycopg.errors.UndefinedTable:
            return 0  # the relay has not created it yet
        return int(row[0]) if row else 0

    first = Relay(
        dsn,
        collected.factory(reject),
        spec=SPEC,
        options=RelayOptions(listen=False, poll_interval_s=0.02, batch_size=8, max_attempts=3),
    )
    with running(first):
        deadline = time.monotonic() + 20
        while attempts_of(poison) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    # The first relay stopped after one or two rejections of the poison message.
    before_restart = attempts_of(poison)
    assert 1 <= before_restart <= 2 and seen["poison"] == before_restart
    relay = run_until_empty(dsn, collected, fail=reject, max_attempts=3, batch_size=8)
    assert seen["poison"] == 3  # not 3 more: the count went on from the first run
    assert relay.stats.dead_lettered == 1
    dead = partitioned.execute("SELECT id, attempts FROM outbox_dead_letter").fetchall()
    assert dead == [(poison, 3)]
    assert partitioned.execute("SELECT count(*) FROM outbox_dead_letter_attempts").fetchone() == (
        0,
    )
    assert flaky in collected.ids and ids_in(partitioned, "outbox_unpublished") == []


def test_global_ordering_publishes_in_strict_id_order_with_several_workers(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(partitioned, "outbox_new", 2000, spec=SPEC)
    relay = run_until_empty(dsn, collected, workers=3, ordering=Ordering.global_, batch_size=50)
    assert collected.ids == ids_in(partitioned, "outbox_new")
    assert relay.stats.published == 2000


def test_key_ordering_keeps_per_key_order(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    partitioned.execute(
        "INSERT INTO outbox_new (message_key, payload) "
        "SELECT 'key-' || (g % 7), json_build_object('g', g) FROM generate_series(1, 1400) g"
    )
    run_until_empty(dsn, collected, workers=3, ordering=Ordering.key, batch_size=40)
    assert collected.duplicates() == 0
    per_key: dict[str, list[int]] = {}
    for message in collected.messages:
        per_key.setdefault(message.key or "", []).append(message.id)
    assert len(per_key) == 7
    for ids in per_key.values():
        assert ids == sorted(ids)


def test_notify_wakes_an_idle_relay(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    from outbox_migrate.relay.writer import WritePhase, insert_message

    relay = Relay(dsn, collected.factory(), spec=SPEC, options=RelayOptions(poll_interval_s=30.0))
    with running(relay):
        time.sleep(1.0)  # the relay is idle, waiting on NOTIFY (poll in 30 s)
        started = time.monotonic()
        with partitioned.transaction():
            new_id = insert_message(partitioned, {"a": 1}, phase=WritePhase.partitioned)
        while new_id not in collected.ids and time.monotonic() - started < 10:
            time.sleep(0.02)
        latency = time.monotonic() - started
    assert new_id in collected.ids
    assert latency < 5.0  # far below the 30 s poll: the NOTIFY woke it


def test_stop_finishes_the_batch_in_flight(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(partitioned, "outbox_new", 100, spec=SPEC)
    in_publish = threading.Event()

    def slow(batch: Sequence[Message]) -> None:
        in_publish.set()
        time.sleep(0.5)

    relay = Relay(
        dsn, collected.factory(slow), spec=SPEC,
        options=RelayOptions(batch_size=10, listen=False, shutdown_timeout_s=5.0),
    )  # fmt: skip
    with running(relay):
        assert in_publish.wait(10)
        relay.stop()
    published = ids_in(partitioned, "outbox_published")
    assert published == sorted(collected.ids)  # what was acknowledged was marked, nothing else
    assert len(published) == 10
    assert relay.stats.abandoned_workers == 0


def test_shutdown_timeout_abandons_the_batch_before_its_mark(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(partitioned, "outbox_new", 10, spec=SPEC)
    in_publish = threading.Event()

    def hang(batch: Sequence[Message]) -> None:
        in_publish.set()
        time.sleep(2.0)

    relay = Relay(
        dsn, collected.factory(hang), spec=SPEC,
        options=RelayOptions(batch_size=10, listen=False, shutdown_timeout_s=0.3),
    )  # fmt: skip
    with running(relay):
        assert in_publish.wait(10)
        relay.stop()
    assert relay.stats.abandoned_workers == 1
    time.sleep(2.5)  # let the abandoned worker come back from the broker and roll back
    assert ids_in(partitioned, "outbox_published") == []
    assert len(ids_in(partitioned, "outbox_unpublished")) == 10


def test_relay_survives_terminated_sessions(
    dsn: str, partitioned: psycopg.Connection, collected: Collected
) -> None:
    insert_rows(partitioned, "outbox_new", 3000, spec=SPEC)
    killed = {"n": 0}

    def kill_sessions_once(batch: Sequence[Message]) -> None:
        if killed["n"] == 0:
            killed["n"] = 1
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name LIKE 'outbox-migrate/% relay' AND datname = current_database()"
                )

    relay = run_until_empty(
        dsn, collected, fail=kill_sessions_once, workers=2, batch_size=100, backoff_base_s=0.01
    )
    assert relay.stats.connection_retries >= 1
    assert set(collected.ids) == set(ids_in(partitioned, "outbox_new"))
    assert ids_in(partitioned, "outbox_unpublished") == []
    # At most the batches in flight when killed: per worker the one being published and,
    # while it reads ahead, the one whose mark was committing meanwhile (docs/relay.md).
    assert collected.duplicates() <= 400


def test_a_claim_failing_after_the_previous_commit_loses_nothing(
    dsn: str, partitioned: psycopg.Connection, collected: Collected, monkeypatch
) -> None:
    """A batch's mark and COMMIT travel with the next claim (pipeline mode). When that claim
    fails — here SQLSTATE 40001 on the 3rd claim, raised once its rows were already fetched
    and locked — the batch before it is committed and counted, the failed claim's transaction
    is rolled back (its rows are claimed again, not lost and not published twice)."""
    from outbox_migrate.relay import batch_loop

    insert_rows(partitioned, "outbox_new", 1000, spec=SPEC)
    original = batch_loop.BatchLoop._claim
    calls = {"n": 0}

    def flaky_claim(self, *args):  # type: ignore[no-untyped-def]
        rows = original(self, *args)
        calls["n"] += 1
        if calls["n"] == 3:
            raise psycopg.errors.SerializationFailure("injected: row moved")
        return rows

    monkeypatch.setattr(batch_loop.BatchLoop, "_claim", flaky_claim)
    relay = run_until_empty(dsn, collected, batch_size=100)
    expected = ids_in(partitioned, "outbox_new")
    assert relay.stats.serialization_retries == 1
    assert collected.ids == expected  # the failed claim's rows came again, in order, once
    assert relay.stats.published == 1000 and relay.stats.batches == 10
    assert ids_in(partitioned, "outbox_unpublished") == []
