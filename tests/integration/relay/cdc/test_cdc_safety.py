"""The CDC relay's safety rules on real PostgreSQL (wal_level = logical): whose slot it may
touch, failed attempts that survive a restart or a crash, least-privilege start, a backlog
published with no transaction open, and broker libraries' logs on one line."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import insert_rows

from outbox_migrate.errors import MessagesRejected, RelayError, SinkUnavailable
from outbox_migrate.relay.cdc.relay import running
from outbox_migrate.relay.message import Message
from tests.integration.relay.conftest import SPEC, Collected, ids_in

from .conftest import cdc_relay, slot_row, wait_for

REPO = Path(__file__).resolve().parents[4]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "relay", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip


# -- slots of another database ---------------------------------------------------------------


def test_a_relay_on_a_second_database_refuses_the_first_ones_slot_and_keeps_it(
    dsn: str, cdc_outbox: psycopg.Connection, other_database: str, collected: Collected
) -> None:
    """Both relays with the default --slot: the second database's relay dropped the first
    one's inactive slot (it took the slot for a first start that died half-way)."""
    insert_rows(cdc_outbox, "outbox_new", 3, spec=SPEC)
    cdc_relay(dsn, collected.factory(), until_caught_up=True).run()
    first = cdc_outbox.info.dbname
    wait_for(lambda: not slot_row(cdc_outbox)[1], 10, "the walsender to exit")
    before = slot_row(cdc_outbox)  # inactive: nothing kept it from a drop

    with pytest.raises(RelayError, match=f"belongs to database {first}"):
        cdc_relay(other_database, collected.factory(), until_caught_up=True).run()
    ran = _cli("--mode", "cdc", "--sink", "stdout", "--until-empty", "--dsn", other_database)
    assert ran.returncode == 2, ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and f"belongs to database {first}" in lines[0], ran.stderr
    assert "Traceback" not in ran.stderr
    dropped = _cli("--drop-slot", "--yes", "--dsn", other_database)
    assert dropped.returncode == 2, dropped.stderr
    assert f"belongs to database {first}" in dropped.stderr

    assert slot_row(cdc_outbox)[:2] == before[:2]  # still there, not moved on
    with psycopg.connect(other_database) as other:  # a refused start wrote nothing
        assert other.execute("SELECT count(*) FROM pg_publication").fetchone() == (0,)
        assert other.execute("SELECT to_regclass('outbox_dead_letter')").fetchone() == (None,)
    insert_rows(cdc_outbox, "outbox_new", 2, spec=SPEC)
    again = cdc_relay(dsn, collected.factory(), until_caught_up=True)
    again.run()
    assert again.stats.backlog == 0 and again.stats.published == 2  # the same stream
    assert collected.duplicates() == 0


def test_a_physical_slot_of_the_same_name_is_refused_and_kept(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """A standby's physical slot named like --slot: the relay took it for its own first
    start that died half-way and dropped it."""
    cdc_outbox.execute("SELECT pg_create_physical_replication_slot('outbox_migrate_cdc')")
    try:
        with pytest.raises(RelayError, match="is a physical slot"):
            cdc_relay(dsn, collected.factory(), until_caught_up=True).run()
        kept = cdc_outbox.execute(
            "SELECT slot_type FROM pg_replication_slots WHERE slot_name = 'outbox_migrate_cdc'"
        ).fetchone()
        assert kept == ("physical",)
    finally:
        cdc_outbox.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = 'outbox_migrate_cdc' AND slot_type = 'physical'"
        )


def test_drop_slot_refuses_another_plugins_slot_and_keeps_slot_and_publication(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """`relay --drop-slot --slot X` dropped a test_decoding slot (another consumer's) and the
    relay's publication with it, exit 0; a running relay then skipped new rows in silence."""
    insert_rows(cdc_outbox, "outbox_new", 2, spec=SPEC)
    cdc_relay(dsn, collected.factory(), until_caught_up=True).run()  # the publication exists
    cdc_outbox.execute("SELECT pg_create_logical_replication_slot('om_other', 'test_decoding')")
    try:
        dropped = _cli("--drop-slot", "--slot", "om_other", "--yes", "--dsn", dsn)
        assert dropped.returncode == 2, dropped.stderr
        (line,) = dropped.stderr.strip().splitlines()
        assert "uses plugin test_decoding" in line and "nothing dropped" in line
        kept = "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'om_other'"
        assert cdc_outbox.execute(kept).fetchone() == (1,)
        assert cdc_outbox.execute("SELECT count(*) FROM pg_publication").fetchone() == (1,)
    finally:
        cdc_outbox.execute("SELECT pg_drop_replication_slot('om_other')")


def test_drop_slot_of_a_misspelt_slot_keeps_the_publication_a_running_relay_streams(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """No slot by that name: the publication was dropped anyway, under a running relay."""
    relay = cdc_relay(dsn, collected.factory())
    with running(relay):
        wait_for(
            lambda: bool((slot_row(cdc_outbox) or (None, False))[1]), 30, "the relay to stream"
        )
        dropped = _cli("--drop-slot", "--slot", "outbox_migrate_cdx", "--yes", "--dsn", dsn)
        assert dropped.returncode == 2, dropped.stderr
        assert "nothing dropped" in dropped.stderr
        assert cdc_outbox.execute("SELECT count(*) FROM pg_publication").fetchone() == (1,)


# -- failed attempts in the database ---------------------------------------------------------


class _Refusing:
    """Acknowledges every message but `poison`, which it refuses (or crashes on)."""

    name = "refusing"

    def __init__(self, collected: Collected, poison: set[int], *, crash: bool = False,
                 on_refusal: object = None) -> None:  # fmt: skip
        self.collected, self.poison, self.crash = collected, poison, crash
        self.on_refusal = on_refusal
        self.refusals = 0

    def publish(self, batch: Sequence[Message]) -> None:
        bad = [m for m in batch if m.id in self.poison]
        if bad and self.crash:
            raise RuntimeError("serializer blew up")  # not a SinkError: the relay stops
        self.collected.add([m for m in batch if m.id not in self.poison])
        if bad:
            self.refusals += 1
            if callable(self.on_refusal):
                self.on_refusal()
            raise MessagesRejected(self.name, {m.id: "payload too large" for m in bad})

    def close(self) -> None:
        return None


def _attempts(conn: psycopg.Connection) -> list[tuple[int, int]]:
    return conn.execute(
        "SELECT id, attempts FROM outbox_dead_letter_attempts ORDER BY id"
    ).fetchall()


def _dead(conn: psycopg.Connection) -> list[tuple[int, int, str]]:
    return conn.execute(
        "SELECT id, attempts, last_error FROM outbox_dead_letter ORDER BY id"
    ).fetchall()


def test_rejections_are_counted_in_the_database_across_a_restart(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """max_attempts 3: one rejection, a restart, two more, and the row is dead-lettered. The
    count lived in memory: the restart started it again, the row was refused 4 times."""
    insert_rows(cdc_outbox, "outbox_new", 5, spec=SPEC)
    poison = ids_in(cdc_outbox, "outbox_new")[2]
    holder: list = []
    sink = _Refusing(collected, {poison}, on_refusal=lambda: holder[0].stop())
    first = cdc_relay(dsn, lambda: sink, max_attempts=3, batch_size=10)
    holder.append(first)
    first.run()  # stopped during its first rejection's backoff
    assert _attempts(cdc_outbox) == [(poison, 1)]
    sink.on_refusal = None
    second = cdc_relay(dsn, lambda: sink, max_attempts=3, until_caught_up=True)
    second.run()
    assert sink.refusals == 3
    assert _dead(cdc_outbox) == [(poison, 3, "payload too large")]
    assert _attempts(cdc_outbox) == []
    assert second.stats.dead_lettered == 1
    assert ids_in(cdc_outbox, "outbox_unpublished") == []
    assert sorted(set(collected.ids)) == [
        i for i in ids_in(cdc_outbox, "outbox_new") if i != poison
    ]


def test_a_message_that_crashes_the_relay_is_dead_lettered_after_max_attempts(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """The sink raises something unexpected on one row of a five-row transaction: every
    restart re-streamed it and crashed again, for ever. Now the crash counts against the
    batch, a row with a failure on record is published alone (so the next crash counts
    against it only), and at max_attempts it goes to the dead-letter table."""
    cdc_relay(dsn, collected.factory(), until_caught_up=True).run()  # streamed, not backlog
    with cdc_outbox.transaction():
        insert_rows(cdc_outbox, "outbox_new", 5, spec=SPEC)
    ids = ids_in(cdc_outbox, "outbox_new")
    poison = ids[2]
    sink = _Refusing(collected, {poison}, crash=True)
    crashes = 0
    for _ in range(5):
        try:
            cdc_relay(dsn, lambda: sink, max_attempts=2, until_caught_up=True).run()
            break
        except RuntimeError:
            crashes += 1
    assert crashes == 2
    assert _dead(cdc_outbox) == [(poison, 2, "RuntimeError: serializer blew up")]
    assert _attempts(cdc_outbox) == []
    assert ids_in(cdc_outbox, "outbox_unpublished") == []
    assert set(ids) - {poison} <= set(collected.ids)
    assert poison not in collected.ids


def test_a_message_that_kills_the_relay_process_is_dead_lettered_after_max_attempts(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """SIGKILL while publishing one row of a three-row transaction (a crash in a broker
    library's C code, the OOM killer): nothing could be counted in the dying process, so the
    relay was killed at every restart, for ever. Now a start that finds the last run never
    stopped counts each attempt before publishing until it has caught up: killed once
    uncounted, then twice counted (--max-attempts 2), then the row is dead-lettered and the
    others go through."""
    cdc_relay(dsn, collected.factory(), until_caught_up=True).run()  # the slot; a clean stop
    with cdc_outbox.transaction():
        for payload in ('{"n": 1}', '{"poison": true}', '{"n": 3}'):
            cdc_outbox.execute("INSERT INTO outbox_new (payload) VALUES (%s)", (payload,))
    poison = ids_in(cdc_outbox, "outbox_new")[1]
    sink = "tests.integration.relay.cdc.killing_sink:KillOnPoison"
    codes = []
    for _ in range(6):
        ran = _cli("--mode", "cdc", "--sink", sink, "--until-empty", "--max-attempts", "2",
                   "--dsn", dsn)  # fmt: skip
        codes.append(ran.returncode)
        if ran.returncode == 0:
            break
    assert codes == [-9, -9, -9, 0], ran.stderr
    assert "relay.cdc_unclean_stop" in ran.stderr
    assert _dead(cdc_outbox) == [
        (poison, 2, "the relay stopped without a trace while publishing it")
    ]
    assert _attempts(cdc_outbox) == []
    assert ids_in(cdc_outbox, "outbox_unpublished") == []
    runs = cdc_outbox.execute("SELECT count(*) FROM outbox_dead_letter_attempts").fetchone()
    assert runs == (0,)  # the last run stopped cleanly: its row is gone too


def test_a_careful_start_takes_back_the_count_when_the_broker_is_down(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """After an unclean stop attempts are counted before publishing; a broker outage is not
    the messages' fault, so those counts are taken back (else an outage during recovery
    would dead-letter healthy messages)."""
    cdc_relay(dsn, collected.factory(), until_caught_up=True).run()  # the slot and tables
    cdc_outbox.execute(  # what a killed run leaves behind
        "INSERT INTO outbox_dead_letter_attempts (source_table, id, attempts, last_error) "
        "VALUES ('cdc-run:outbox_migrate_cdc', 0, 1, 'a relay is running on this slot')"
    )
    insert_rows(cdc_outbox, "outbox_new", 3, spec=SPEC)

    def down(batch: Sequence[Message]) -> None:
        raise SinkUnavailable("collect", "broker down (test)")

    relay = cdc_relay(dsn, collected.factory(down), backoff_cap_s=0.05, max_attempts=2)
    with running(relay):
        wait_for(lambda: relay.stats.sink_failures >= 3, what="publishes while down")
    assert relay.careful_until > 0
    assert _attempts(cdc_outbox) == []  # nothing counted against the messages; run row gone
    assert _dead(cdc_outbox) == []


def test_a_role_without_create_starts_with_pre_created_dead_letter_tables(
    cdc_role: str, cdc_outbox: psycopg.Connection, collected: Collected,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """CREATE TABLE IF NOT EXISTS needs the CREATE right even when the table exists: the
    relay warned that dead-lettering was unavailable although the tables were there."""
    insert_rows(cdc_outbox, "outbox_new", 4, spec=SPEC)
    poison = ids_in(cdc_outbox, "outbox_new")[1]
    caplog.set_level(logging.WARNING, logger="outbox_migrate.relay")
    sink = _Refusing(collected, {poison})
    relay = cdc_relay(cdc_role, lambda: sink, max_attempts=1, until_caught_up=True)
    relay.run()
    assert not [r for r in caplog.records if "dead_letter_unavailable" in r.getMessage()]
    assert _dead(cdc_outbox) == [(poison, 1, "payload too large")]
    assert ids_in(cdc_outbox, "outbox_unpublished") == []
    insert_rows(cdc_outbox, "outbox_new", 2, spec=SPEC)  # and it streams
    cdc_relay(cdc_role, collected.factory(), until_caught_up=True).run()
    assert len(set(collected.ids)) == 5


def test_a_role_that_may_not_write_the_attempts_table_still_streams(
    cdc_role: str, cdc_outbox: psycopg.Connection, collected: Collected,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The run's row (relay/cdc/relay.py) is one more write at the start: a role granted less than
    that runs without the guard, as it ran before there was one, and is told at start what
    dead-lettering lacks."""
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict

    role = conninfo_to_dict(cdc_role)["user"]
    cdc_outbox.execute(
        sql.SQL("REVOKE INSERT, UPDATE ON outbox_dead_letter_attempts FROM {}").format(
            sql.Identifier(str(role))
        )
    )
    insert_rows(cdc_outbox, "outbox_new", 3, spec=SPEC)
    caplog.set_level(logging.WARNING, logger="outbox_migrate.relay")
    cdc_relay(cdc_role, collected.factory(), until_caught_up=True).run()
    assert sorted(collected.ids) == ids_in(cdc_outbox, "outbox_new")
    # Said at start, naming the grant; the guard is not tried (it would need the same).
    warned = [r.getMessage() for r in caplog.records if "dead_letter_unavailable" in r.getMessage()]
    assert len(warned) == 1 and "INSERT on" in warned[0] and "GRANT" in warned[0], warned


# -- the first start's backlog ---------------------------------------------------------------


def _holding(conn: psycopg.Connection) -> list[tuple[object, ...]]:
    """The relay's sessions (any client or walsender of this database but the test's own)
    inside a transaction or holding an xmin."""
    return conn.execute(
        "SELECT backend_type, application_name, state, backend_xmin::text "
        "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND backend_type IN ('client backend', 'walsender') "  # not autovacuum's workers
        "AND (backend_xmin IS NOT NULL OR state LIKE 'idle in transaction%')"
    ).fetchall()


def test_the_backlog_is_published_with_no_transaction_or_xmin_held_while_the_broker_waits(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """The backlog was published inside the exported snapshot's REPEATABLE READ transaction:
    idle in transaction, its xmin holding back VACUUM, for as long as the broker took. Rows
    written meanwhile come once, through the stream (the snapshot still decides the
    backlog)."""
    insert_rows(cdc_outbox, "outbox_new", 300, spec=SPEC)
    backlog = ids_in(cdc_outbox, "outbox_new")
    waiting, release = threading.Event(), threading.Event()

    def slow_second_batch(batch: Sequence[Message]) -> None:
        if collected.batches == 1:
            waiting.set()
            release.wait(30)

    relay = cdc_relay(dsn, collected.factory(slow_second_batch), batch_size=100)
    with running(relay):
        assert waiting.wait(30), "the second batch never reached the broker"
        held = _holding(cdc_outbox)
        insert_rows(cdc_outbox, "outbox_new", 50, spec=SPEC)  # after the consistent point
        release.set()
        wait_for(lambda: len(collected.ids) >= 350, what="the backlog and the stream")
        wait_for(lambda: not ids_in(cdc_outbox, "outbox_unpublished"), what="the marks")
    assert held == []
    assert relay.stats.backlog == 300
    assert collected.ids[:300] == backlog
    assert sorted(collected.ids) == ids_in(cdc_outbox, "outbox_new")
    assert collected.duplicates() == 0


# -- broker libraries' log lines ---------------------------------------------------------------


def test_cdc_mode_logs_a_broker_librarys_traceback_as_one_line(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected,
    unrouted: list[logging.LogRecord],
) -> None:  # fmt: skip
    """pika logs its errors with a traceback (as when RabbitMQ goes away); the polling relay
    folded them into one `relay.sink_library` line, CDC mode printed them raw."""
    insert_rows(cdc_outbox, "outbox_new", 2, spec=SPEC)

    def library_complains(batch: Sequence[Message]) -> None:
        try:
            raise ConnectionResetError("Connection reset by peer")
        except ConnectionResetError:
            logging.getLogger("pika.adapters.utils.io_services_utils").exception(
                "_AsyncBaseTransport._produce() failed, aborting connection"
            )

    cdc_relay(dsn, collected.factory(library_complains), until_caught_up=True).run()
    assert len(collected.ids) == 2
    assert not [r.name for r in unrouted if r.name.startswith("pika")]
    assert not [r.getMessage() for r in unrouted if r.exc_info]
    routed = [
        r.getMessage() for r in unrouted if "relay.sink_library logger=pika" in r.getMessage()
    ]
    assert routed and all("\n" not in m for m in routed)
    assert "ConnectionResetError: Connection reset by peer" in routed[0]


def test_cdc_mode_logs_a_multi_line_broker_error_as_one_line(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A broker client's error text can span lines (a server's reply quoted whole): the
    relay's own `relay.sink_unavailable` line carried it as it came."""
    insert_rows(cdc_outbox, "outbox_new", 2, spec=SPEC)
    failed: list[int] = []

    def once(batch: Sequence[Message]) -> None:
        if not failed:
            failed.append(1)
            raise SinkUnavailable("collect", "NOT_FOUND - no queue 'orders'\n  in vhost '/'")

    caplog.set_level(logging.INFO, logger="outbox_migrate.relay")
    cdc_relay(dsn, collected.factory(once), until_caught_up=True).run()
    assert sorted(set(collected.ids)) == ids_in(cdc_outbox, "outbox_new")
    lines = [r.getMessage() for r in caplog.records if r.name == "outbox_migrate.relay"]
    assert any("relay.sink_unavailable" in m and "in vhost '/'" in m for m in lines), lines
    assert all("\n" not in m for m in lines), lines


def test_two_copies_of_one_id_refused_together_are_both_dead_lettered(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """Two unpublished rows with one id in one transaction, both refused: the second copy's
    dead letter hit the (source_table, id) key and was dropped (ON CONFLICT DO NOTHING), and
    the row was then marked — lost. Now each copy is kept with its own payload."""
    cdc_relay(dsn, collected.factory(), until_caught_up=True).run()  # the slot and tables
    twin = 5_000_000
    with cdc_outbox.transaction():
        insert_rows(cdc_outbox, "outbox_new", 2, spec=SPEC)
        for copy in (1, 2):
            cdc_outbox.execute(
                "INSERT INTO outbox_new (id, payload) OVERRIDING SYSTEM VALUE VALUES (%s, %s)",
                (twin, f'{{"copy": {copy}}}'),
            )
    sink = _Refusing(collected, {twin})
    relay = cdc_relay(dsn, lambda: sink, max_attempts=1, until_caught_up=True)
    relay.run()
    dead = cdc_outbox.execute(
        "SELECT source_table, id, attempts, payload FROM outbox_dead_letter ORDER BY 1"
    ).fetchall()
    assert [(d[0], d[1], d[2], d[3]) for d in dead] == [
        ("public.outbox_new", twin, 1, '{"copy": 1}'),
        ("public.outbox_new copy 2", twin, 1, '{"copy": 2}'),
    ], dead
    assert ids_in(cdc_outbox, "outbox_unpublished") == []
    assert relay.stats.dead_lettered == 2


def test_a_role_without_replication_is_refused_at_start_not_retried_for_ever(
    dsn: str, cdc_outbox: psycopg.Connection
) -> None:
    """The stream's connection was refused at every try ("permission denied to start WAL
    sender"), which the relay logged as a lost connection and retried until killed."""
    from psycopg.conninfo import make_conninfo

    cdc_outbox.execute("CREATE ROLE om_norep LOGIN")
    cdc_outbox.execute("GRANT SELECT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO om_norep")
    ran = _cli("--mode", "cdc", "--sink", "stdout", "--until-empty",
               "--dsn", make_conninfo(dsn, user="om_norep"))  # fmt: skip
    assert ran.returncode == 2, ran.stderr
    (line,) = ran.stderr.strip().splitlines()
    assert 'ALTER ROLE "om_norep" REPLICATION' in line


def test_a_second_relay_on_a_streamed_slot_is_refused_and_leaves_the_first_ones_run(
    dsn: str, cdc_outbox: psycopg.Connection, collected: Collected
) -> None:
    """A second relay on the same slot took the first's run record for an unclean stop,
    retried "slot is active" for ever, and on its way out removed the first's record."""
    run = "SELECT count(*) FROM outbox_dead_letter_attempts WHERE source_table LIKE 'cdc-run:%'"
    relay = cdc_relay(dsn, collected.factory())
    with running(relay):
        wait_for(lambda: bool((slot_row(cdc_outbox) or (None, False))[1]), 30, "the stream")
        second = _cli("--mode", "cdc", "--sink", "stdout", "--until-empty", "--dsn", dsn)
        assert second.returncode == 3, second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert "streamed by another process" in line
        assert cdc_outbox.execute(run).fetchone() == (1,)  # the first run's record is kept
        insert_rows(cdc_outbox, "outbox_new", 2, spec=SPEC)
        wait_for(lambda: len(collected.ids) == 2, 30, "the first relay to go on")
