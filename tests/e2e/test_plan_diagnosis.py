"""`plan`'s diagnosis from evidence: which column records delivery (its type, default and
contents) and whether the table deletes what it delivers (its own `pg_stat_user_tables`
counters), on frameworks' outbox tables as they create them, with no setting.

Before, eventuate's `published smallint`, Watermill's `acked boolean`, CAP's `StatusName`
and a plain `published smallint NOT NULL DEFAULT 0` were all told "this outbox deletes
delivered rows: there is nothing to partition" (no column was named like a timestamp marker);
Wolverine's `deliver_by` (a delivery deadline) was suggested as the marker and, given as
published_column, passed `plan`, as MassTransit's `EnqueueTime` did; `plan` named only the
first blocker; `wizard --dsn` exited 1 with an internal error when the id column was not `id`.
"""

from __future__ import annotations

import json
import shlex
import time
from typing import Any

import psycopg
import pytest

from outbox_migrate.advisory.introspect import introspect
from outbox_migrate.advisory.table_facts import TableFacts
from outbox_migrate.config import load_settings
from outbox_migrate.errors import SchemaError
from outbox_migrate.relay.options import Mode, RelayOptions
from outbox_migrate.relay.worker import Relay
from outbox_migrate.runner import Runner
from tests.e2e.test_zoo_flags import EVENTUATE_DDL
from tests.e2e.test_zoo_frameworks import MASSTRANSIT
from tests.support.cli import error_line, run_cli
from tests.support.zoo import Collector

PLAIN_DDL = """
    CREATE TABLE plain_outbox (
        id bigserial PRIMARY KEY, payload jsonb NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        published smallint NOT NULL DEFAULT 0)
"""

WATERMILL_DDL = """
    CREATE TABLE "watermill_orders" (
        "offset" BIGSERIAL, "uuid" VARCHAR(36) NOT NULL, "payload" JSON DEFAULT NULL,
        "metadata" JSON DEFAULT NULL, "acked" BOOLEAN NOT NULL DEFAULT FALSE,
        "created_at" TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
        PRIMARY KEY ("offset"))
"""
"""ThreeDotsLabs/watermill-sql, the PostgreSQL queue schema (`acked`, rows kept once acked),
for a topic `orders`, as read on its default branch."""

CAP_DDL = """
    CREATE SCHEMA cap;
    CREATE TABLE cap.published (
        "Id" BIGINT PRIMARY KEY NOT NULL, "Version" VARCHAR(20) NOT NULL,
        "Name" VARCHAR(200) NOT NULL, "Content" TEXT NULL, "Retries" INT NOT NULL,
        "Added" TIMESTAMP NOT NULL, "ExpiresAt" TIMESTAMP NULL,
        "StatusName" VARCHAR(50) NOT NULL)
"""
"""DotNetCore.CAP, src/DotNetCore.CAP.PostgreSql/IStorageInitializer.PostgreSql.cs: the
application supplies the (snowflake) ids; a sent message gets StatusName Succeeded and an
ExpiresAt ahead of now, when the cleanup may delete it."""

WOLVERINE_DDL = """
    CREATE TABLE wolverine_outgoing_envelopes (
        id uuid NOT NULL CONSTRAINT pkey_wolverine_outgoing_envelopes_id PRIMARY KEY,
        owner_id integer NOT NULL, destination varchar NOT NULL,
        deliver_by timestamp with time zone, body bytea NOT NULL,
        attempts integer DEFAULT 0, message_type varchar NOT NULL)
"""
"""JasperFx/wolverine, Wolverine.Postgresql's outgoing envelope table: the sender deletes an
envelope once the broker has it; `deliver_by` is the message's deadline."""

WOLVERINE_INSERT = (
    "INSERT INTO wolverine_outgoing_envelopes VALUES (gen_random_uuid(), 0, "
    "'rabbitmq://queue/orders', now() + interval '1 hour', '\\x00', 0, 'OrderPlaced')"
)
MASSTRANSIT_INSERT = (
    'INSERT INTO "OutboxMessage" ("EnqueueTime", "SentTime", "MessageId", "ContentType", '
    '"MessageType", "Body") VALUES (NULL, now(), gen_random_uuid(), \'application/json\', '
    "'urn:message:Orders:OrderPlaced', '{}')"
)


def facts_of(conn: psycopg.Connection[Any], pattern: str = "hoper", **names: Any) -> TableFacts:
    return introspect(conn, load_settings(names, environ={}).spec, pattern)


def codes(facts: TableFacts) -> list[str]:
    return [b.code for b in facts.blockers]


def live_a_while(dsn: str, table: str, insert: str, *, sent: str, rows: int = 150) -> None:
    """The framework at work: `rows` messages written, most of them then sent with `sent`,
    in a session that ends (its counters reach pg_stat_user_tables), then waited for."""
    with psycopg.connect(dsn, autocommit=True) as app:
        for _ in range(rows):
            app.execute(insert)
        app.execute(sent)
    deadline = time.monotonic() + 15
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT n_tup_ins, n_tup_upd + n_tup_del FROM pg_stat_user_tables "
                "WHERE relid = to_regclass(%s)",
                (table,),
            ).fetchone()
            if row is not None and row[0] >= rows and row[1] > 0:
                return
            assert time.monotonic() < deadline, f"no statistics for {table}: {row}"
            time.sleep(0.2)


@pytest.mark.newest_pg_only
def test_a_plain_smallint_flag_gets_a_working_plan_and_run_with_no_setting(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(PLAIN_DDL)
        conn.execute("INSERT INTO plain_outbox (payload) SELECT '{}' FROM generate_series(1, 5)")
        conn.execute("UPDATE plain_outbox SET published = 1 WHERE id <= 2")
        facts = facts_of(conn, table="plain_outbox")
    assert facts.blockers == []
    assert facts.detected_marker == "published"
    detected = [n.message for n in facts.notes if n.code == "marker-detected"]
    assert detected == [
        "plain_outbox.published records delivery: smallint DEFAULT 0 (values seen: 0, 1)"
    ]
    planned = run_cli("plan", "--pattern", "hop", "--dsn", dsn, "--table", "plain_outbox",
                      "--format", "json")  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    document = json.loads(planned.stdout)
    assert document["spec"]["published_column"] == "published"
    assert (document["spec"]["unpublished_value"], document["spec"]["published_value"]) == (
        "0",
        "1",
    )
    # `run` takes the same marker: V2 partitions by it, and the unpublished rows are its 0
    settings = load_settings({"table": "plain_outbox", "gate_window_s": 0.1}, environ={})
    with Runner(dsn, settings, "hop") as runner:
        runner.run("V2")
    with psycopg.connect(dsn, autocommit=True) as conn:
        key = conn.execute("SELECT pg_get_partkeydef('outbox_new'::regclass)").fetchone()
        bound = conn.execute(
            "SELECT pg_get_expr(relpartbound, oid) FROM pg_class WHERE relname = "
            "'outbox_unpublished'"
        ).fetchone()
    assert key == ("LIST (published)",)
    assert bound == ("FOR VALUES IN ('0')",)
    with psycopg.connect(dsn, autocommit=True) as conn:  # V1's relay drains the old table
        conn.execute("UPDATE plain_outbox SET published = 1")
    with Runner(dsn, settings, "hop") as runner:
        runner.run("V3")
        assert runner.verify() == []
    # and the relay, with the same (absent) setting, publishes by it
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox_new (payload) VALUES ('{\"n\": 1}')")
    collector = Collector()
    Relay(dsn, collector.factory(), spec=settings.spec,
          options=RelayOptions(mode=Mode.partitioned, until_empty=True)).run()  # fmt: skip
    assert len(collector.messages) == 1
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute("SELECT count(*) FROM outbox_unpublished").fetchone()
    assert left == (0,)


@pytest.mark.newest_pg_only
def test_eventuates_message_gets_its_flag_and_every_blocker_at_once(dsn: str) -> None:
    """eventuate-tram's `message` as published (a nullable `published smallint DEFAULT 0`,
    varchar ids): the marker is found without a setting, and both remaining blockers are
    listed in one run, the flag's with SQL that runs."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EVENTUATE_DDL)
        facts = facts_of(conn, table="message")
        assert facts.detected_marker == "published"
        assert codes(facts) == ["id-application", "published-flag-nullable", "lost-unique"]
        refused = run_cli("plan", "--pattern", "hoper", "--dsn", dsn, "--table", "message")
        assert error_line(refused) == (
            "outbox-migrate: error: 3 blockers stop the migration of message, each listed with "
            "its fix"
        )
        listed = refused.stderr.splitlines()[:-1]
        assert len(listed) == 3
        assert listed[0].startswith("blocker 1/3: message.id is character varying(1000)")
        assert listed[1].startswith("blocker 2/3: message.published is a nullable flag")
        assert listed[2].startswith("blocker 3/3: primary key message_pkey on message (id)")
        fix = facts.blockers[1].fix_sql
        assert fix and fix in listed[1]
        conn.execute(fix)
        # one round: the SQL run, the setting given and the loss accepted, as the three
        # blockers said, and nothing else stands in the way
        named = {"table": "message", "id_kind": "application", "created_column": ""}
        assert codes(facts_of(conn, **named, accept_lost_unique=["message_pkey"])) == []


@pytest.mark.newest_pg_only
def test_watermills_queue_gets_acked_as_marker_and_its_primary_key_as_id(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(WATERMILL_DDL)
        conn.execute(
            'INSERT INTO "watermill_orders" ("uuid", "payload", "metadata") SELECT '
            "gen_random_uuid()::text, '{}', '{}' FROM generate_series(1, 4)"
        )
        conn.execute('UPDATE "watermill_orders" SET "acked" = TRUE WHERE "offset" <= 2')
        facts = facts_of(conn, table="watermill_orders")
        assert facts.detected_marker == "acked"
        assert codes(facts) == ["id-missing"]  # not delete-on-delivery, nor the lost pkey
        assert facts.blockers[0].remedy == (
            'set id_column to the outbox\'s id column, here the primary key: id_column = "offset" '
            "(--id-column offset)"
        )
    followed = run_cli("plan", "--pattern", "hoper", "--dsn", dsn, "--table", "watermill_orders",
                       "--id-column", "offset", "--payload-column", "payload",
                       "--created-column", "created_at", "--format", "json")  # fmt: skip
    assert followed.returncode == 0, followed.stderr
    spec = json.loads(followed.stdout)["spec"]
    assert (spec["published_column"], spec["unpublished_value"], spec["published_value"]) == (
        "acked",
        "false",
        "true",
    )
    # wizard --dsn measures it, whatever the id column is called (it exited 1 before)
    wizard = run_cli("wizard", "--dsn", dsn, "--no-pause", "--no-keep-old-rows",
                     "--table", "watermill_orders", "--format", "json")  # fmt: skip
    assert wizard.returncode == 0, wizard.stderr
    document = json.loads(wizard.stdout)
    assert document["measurements"]["blockers"] == [
        "watermill_orders has no column 'id': set id_column to the outbox's id column, here "
        'the primary key: id_column = "offset" (--id-column offset)'
    ]
    # its Next: command carries the suggested id, and runs as printed
    command = shlex.split(document["next"])
    assert command[:2] == ["outbox-migrate", "plan"] and "--id-column" in command
    assert run_cli(*command[1:]).returncode == 0
    wizard = run_cli("wizard", "--dsn", dsn, "--no-pause", "--no-keep-old-rows",
                     "--table", "watermill_orders", "--id-column", "offset",
                     "--format", "json")  # fmt: skip
    assert wizard.returncode == 0, wizard.stderr
    assert json.loads(wizard.stdout)["measurements"]["blockers"] == []


@pytest.mark.newest_pg_only
def test_caps_status_is_named_and_its_expiry_is_not(dsn: str) -> None:
    """CAP keeps sent messages (Succeeded) until they expire: a status to partition by, not a
    delete-on-delivery outbox; ExpiresAt lies ahead of now and is never suggested."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(CAP_DDL)
        conn.execute(
            'INSERT INTO cap.published ("Id", "Version", "Name", "Content", "Retries", "Added", '
            "\"StatusName\") SELECT 2100000000000000000 + g, 'v1', 'orders', '{}', 0, "
            "now(), 'Scheduled' FROM generate_series(1, 6) g"
        )
        conn.execute(
            'UPDATE cap.published SET "StatusName" = \'Succeeded\', "ExpiresAt" = now() + '
            "interval '1 day' WHERE \"Id\" <= 2100000000000000003"
        )
        facts = facts_of(conn, schema="cap", table="published", id_column="Id")
    assert "delete-on-delivery" not in codes(facts)
    status = next(b for b in facts.blockers if b.code == "status-column")
    assert 'published_column = "StatusName", unpublished_value = ' in status.remedy
    assert "values seen: Scheduled, Succeeded" in status.remedy
    assert "ExpiresAt" not in status.remedy


# on every version: the counters reach pg_stat differently before PostgreSQL 15
def test_wolverines_outgoing_envelopes_are_refused_as_delete_on_delivery(dsn: str) -> None:
    """Wolverine deletes an envelope once sent. Without its counters (a fresh table) its
    deadline is still not a marker: not suggested, and refused when given."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(WOLVERINE_DDL)
        conn.execute(WOLVERINE_INSERT)
        fresh = facts_of(conn, table="wolverine_outgoing_envelopes", id_kind="application")
        # beside the id's own blocker (random uuids, no order column)
        assert codes(fresh) == ["order-random-uuid", "delete-on-delivery"]
        assert "deliver_by" not in fresh.blockers[1].remedy
        given = facts_of(conn, table="wolverine_outgoing_envelopes", id_kind="application",
                         published_column="deliver_by")  # fmt: skip
        assert "published-ahead" in codes(given)
    live_a_while(dsn, "wolverine_outgoing_envelopes", WOLVERINE_INSERT,
                 sent="DELETE FROM wolverine_outgoing_envelopes WHERE id IN (SELECT id FROM "
                 "wolverine_outgoing_envelopes LIMIT 120)")  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        for names in ({}, {"published_column": "deliver_by", "id_kind": "application",
                           "order_column": "deliver_by"}):  # fmt: skip
            facts = facts_of(conn, table="wolverine_outgoing_envelopes", **names)
            assert codes(facts) == ["delete-on-delivery"], names
            assert facts.warnings == []
            assert "151 rows inserted, 120 deleted and 0 updated" in facts.blockers[0].message


# on every version: the counters reach pg_stat differently before PostgreSQL 15
def test_masstransits_outbox_is_refused_even_with_a_published_column(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(MASSTRANSIT.ddl)
    live_a_while(dsn, "\"OutboxMessage\"", MASSTRANSIT_INSERT,
                 sent='DELETE FROM "OutboxMessage" WHERE "SequenceNumber" <= 120')  # fmt: skip
    names = ["--table", "OutboxMessage", "--id-column", "SequenceNumber", "--payload-column",
             "Body", "--published-column", "EnqueueTime"]  # fmt: skip
    refused = run_cli("plan", "--pattern", "hop", "--dsn", dsn, *names)
    assert error_line(refused, only=True) == (
        "outbox-migrate: error: OutboxMessage deletes the rows it delivers: its statistics "
        "show 150 rows inserted, 120 deleted and 0 updated: this outbox deletes delivered "
        "rows: there is nothing to partition (it holds only undelivered messages and stays "
        "small by itself), whatever published_column names"
    )
    # `run` admits with the same judgement, before writing anything
    settings = load_settings({"table": "OutboxMessage", "id_column": "SequenceNumber",
                              "published_column": "EnqueueTime"}, environ={})  # fmt: skip
    with (
        pytest.raises(SchemaError, match="deletes the rows it delivers"),
        Runner(dsn, settings, "hop") as runner,
    ):
        runner.run("V2")


# on every version: the counters reach pg_stat differently before PostgreSQL 15
def test_an_outbox_that_marks_then_deletes_is_not_delete_on_delivery(dsn: str) -> None:
    """Retention deletes rows the relay marked first: the counters show the updates."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(PLAIN_DDL)
    live_a_while(dsn, "plain_outbox", "INSERT INTO plain_outbox (payload) VALUES ('{}')",
                 sent="UPDATE plain_outbox SET published = 1; DELETE FROM plain_outbox "
                 "WHERE id <= 120")  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        facts = facts_of(conn, table="plain_outbox")
    assert (facts.inserts, facts.updates, facts.deletes) == (150, 150, 120)
    assert facts.blockers == [] and facts.detected_marker == "published"


@pytest.mark.newest_pg_only
def test_a_local_time_without_a_zone_is_not_taken_for_a_deadline(dsn: str) -> None:
    """A writer in UTC+14 stores its wall-clock time in a `timestamp` marker: 14 hours
    "ahead" of UTC, still a time of publication; a time with its zone an hour ahead is not."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE local_outbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            "payload text NOT NULL, sent_at timestamp, due_at timestamptz);"
            "INSERT INTO local_outbox (payload, sent_at, due_at) VALUES "
            "('x', now() AT TIME ZONE 'Pacific/Kiritimati', now() + interval '1 hour'), "
            "('y', NULL, NULL)"
        )
        local = facts_of(conn, table="local_outbox", published_column="sent_at")
        due = facts_of(conn, table="local_outbox", published_column="due_at")
    assert local.blockers == []
    assert [b.code for b in due.blockers] == ["published-ahead"]
