"""The frameworks' wing of the schema zoo under load: each framework's outbox table from its
published DDL, migrated with the pattern `wizard` recommends for it while writers insert with
the framework's own INSERT and our relay publishes; then the framework's own read, mark and
cleanup statements run against the migrated table and must still mean what they meant.

What a real team does, and what this plays: during the migration our relay publishes (the
framework's dispatcher is switched off); the optional original-name phases then give the
partitioned table the framework's table name, which the framework's configuration
(NServiceBus's prefix, jaiminho's Django model) cannot easily change, and the framework's
statements run on that name. The INSERTs are the framework's own, with only `RETURNING <id>`
appended so that the test knows what it wrote (the framework ignores the result; what is
stored is the same). Values the framework binds from the application (a new
uuid, the send time) are produced by the server here.

Delete-on-delivery outboxes (MassTransit's EF Core outbox, the Debezium example) have nothing
to partition: for them the test asserts that `run` refuses with its own line and writes
nothing. Flag markers (eventuate-tram's `published smallint`, django-outbox-pattern's status)
and status columns beside the timestamp (Spring Modulith, NServiceBus's `Dispatched` kept in
step) are in `test_zoo_frameworks_flags_load.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_migrate.advisory.introspect import introspect
from outbox_migrate.errors import SchemaError
from outbox_migrate.relay.message import Message
from outbox_migrate.runner import Runner
from outbox_migrate.wizard import Answers, recommend
from tests.e2e.test_zoo_frameworks import (
    BRIGHTER,
    DEBEZIUM_EXAMPLE,
    MASSTRANSIT,
    NSERVICEBUS,
    FrameworkTable,
)
from tests.support.zoo import SEEDED_PUBLISHED, Outcome, ZooTable, migrate_under_load

Check = Callable[[psycopg.Connection[Any], ZooTable], None]


@dataclass(frozen=True)
class FrameworkUnderLoad:
    zoo: ZooTable
    source: str
    """Where the DDL and the statements are published (repository, file, version)."""
    answers: Answers
    """The wizard's three answers as this framework's team would give them (see `why`)."""
    why: str
    number_of: Callable[[Message], int]
    """The writer's sequence number n, read back from what the sink received."""
    header_of: Callable[[Message, int], None]
    """Asserts that message n arrived with the header(s) the framework gave it."""
    framework_queries: Check
    """The framework's own read / mark / cleanup statements on the migrated table."""


def partition_of(conn: psycopg.Connection[Any], table: sql.Identifier, column: str,
                  value: Any) -> str | None:  # fmt: skip
    """The bound of the partition that holds the row (`DEFAULT` = the published one)."""
    row = conn.execute(
        sql.SQL(
            "SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_class c "
            "WHERE c.oid = (SELECT tableoid FROM {} WHERE {} = %s)"
        ).format(table, sql.Identifier(column)),
        (value,),
    ).fetchone()
    return None if row is None else str(row[0])


# -- Brighter ---------------------------------------------------------------------------------

BRIGHTER_INSERT = (
    # PostgreSqlQueries.AddCommand of the release whose OutboxDdl is BRIGHTER.ddl (the later
    # PartitionKey column is not in that DDL); HeaderBag is the JSON text of the header bag
    "INSERT INTO {table} (MessageId, MessageType, Topic, Timestamp, CorrelationId, ReplyTo, "
    "ContentType, HeaderBag, Body) VALUES (gen_random_uuid(), 'MT_EVENT', 'orders', "
    "now()::timestamptz, gen_random_uuid(), NULL, 'text/plain', "
    "json_build_object('n', %(n)s::text, 'topic', 'orders')::text, "
    "json_build_object('n', %(n)s)::text) RETURNING Id"
)
BRIGHTER_OUTSTANDING = (
    # PostgreSqlQueries.PagedOutstandingCommand, @OutstandingSince = 0 ms, page 1 of 100
    "SELECT * FROM (SELECT ROW_NUMBER() OVER(ORDER BY Timestamp ASC) AS NUMBER, * FROM {table} "
    "WHERE DISPATCHED IS NULL) AS TBL WHERE TIMESTAMP < (CURRENT_TIMESTAMP + (0 || "
    "' millisecond')::INTERVAL) AND NUMBER BETWEEN ((1-1)*100+1) AND (1*100) ORDER BY "
    "Timestamp ASC"
)
BRIGHTER_MARK = "UPDATE {table} SET Dispatched = now() WHERE MessageId = %(message_id)s"
BRIGHTER_GET = "SELECT * FROM {table} WHERE MessageId = %(message_id)s"
BRIGHTER_DELETE = "DELETE FROM {table} WHERE MessageId IN ( %(message_id)s )"


def _brighter_queries(conn: psycopg.Connection[Any], zoo: ZooTable) -> None:
    """Brighter's sweeper reads the outstanding page, sends, marks by MessageId; its GetMessage
    finds any message by MessageId; its DeleteMessages removes by MessageId."""
    table = sql.Identifier(zoo.settings["table"])

    def run(statement: str, **params: Any) -> psycopg.Cursor[Any]:
        return conn.execute(sql.SQL(statement).format(table=table), params)  # type: ignore[arg-type]

    assert run(BRIGHTER_OUTSTANDING).fetchall() == []  # our relay published everything
    new_id = run(BRIGHTER_INSERT, n=10**6).fetchone()[0]  # type: ignore[index]
    outstanding = run(BRIGHTER_OUTSTANDING).fetchall()
    assert [row[1] for row in outstanding] == [new_id]  # column 1: Id (0 is NUMBER)
    message_id = outstanding[0][2]
    assert run(BRIGHTER_MARK, message_id=message_id).rowcount == 1
    assert run(BRIGHTER_OUTSTANDING).fetchall() == []
    # marked, the row moved to the published partition: the old table, now the DEFAULT
    assert partition_of(conn, table, "messageid", message_id) == "DEFAULT"
    # every message published during the migration is found by its MessageId, once
    first = conn.execute(
        sql.SQL("SELECT MessageId FROM {} ORDER BY Id LIMIT 1").format(table)
    ).fetchone()
    assert first is not None and len(run(BRIGHTER_GET, message_id=first[0]).fetchall()) == 1
    assert run(BRIGHTER_DELETE, message_id=message_id).rowcount == 1
    assert run(BRIGHTER_GET, message_id=message_id).fetchall() == []


def _brighter_header(message: Message, n: int) -> None:
    headers = message.headers()
    assert (headers.get("n"), headers.get("topic")) == (str(n), "orders"), message


BRIGHTER_LOAD = FrameworkUnderLoad(
    zoo=ZooTable(
        name="brighter",
        ddl=BRIGHTER.ddl,
        settings={
            **BRIGHTER.settings,
            "partitioned_table": "brighter_outbox_new",
            "unpublished_partition": "brighter_outbox_unpublished",
            "published_partition": "brighter_outbox_published",
            "headers_column": "headerbag",
            # Brighter deduplicates by MessageId; PostgreSQL cannot keep that UNIQUE on a
            # table partitioned by Dispatched. Accepted here (every MessageId is a fresh
            # uuid); the alternative is a deduplication table written in the same
            # transaction (docs/patterns.md, "Unique keys the partitioned table cannot
            # keep are blockers").
            "accept_lost_unique": ["brighter_outbox_messageid_key"],
        },
        insert=BRIGHTER_INSERT,
        header=("n", "{n}"),
        include_optional=True,
        original_name=True,
    ),
    source=BRIGHTER.source + " at commit 14a62813e94d; statements: "
    "src/Paramore.Brighter.Outbox.PostgreSql/PostgreSqlQueries.cs at commit 18b01b1b6da8 "
    "(AddCommand, PagedOutstandingCommand, MarkDispatchedCommand, GetMessageCommand, "
    "DeleteMessagesCommand)",
    answers=Answers(pause=False, keep_old_rows=True, immediate_access=True),
    why="Brighter's GetMessage and its dispatched pages read published messages at any time",
    number_of=lambda m: int(json.loads(m.payload)["n"]),
    header_of=_brighter_header,
    framework_queries=_brighter_queries,
)

# -- NServiceBus ------------------------------------------------------------------------------

NSB_STORE = (
    # SqlDialect_PostgreSql.GetOutboxStoreCommand, its `public."…"` as {table} (composed
    # schema-qualified); Operations holds the outgoing messages, each with its own headers
    'insert into {table} ("MessageId", "Operations", "PersistenceVersion") values '
    "(gen_random_uuid()::text, jsonb_build_array(jsonb_build_object('MessageId', "
    "'out-' || %(n)s, 'Headers', jsonb_build_object('n', %(n)s::text), 'Body', "
    "jsonb_build_object('n', %(n)s))), '7.0.0') RETURNING \"MessageId\""
)
NSB_GET = (
    # GetOutboxGetCommand: run for every incoming message; Dispatched true means "done"
    'select "Dispatched", "Operations" from {table} where "MessageId" = %(message_id)s'
)
NSB_SET_AS_DISPATCHED = (
    'update {table} set "Dispatched" = true, "DispatchedAt" = now() at time zone '
    "'UTC', \"Operations\" = '[]' where \"MessageId\" = %(message_id)s"
)
NSB_CLEANUP = (
    # GetOutboxCleanupCommand (by MessageId; older releases selected by ctid, which the
    # migration's guard makes safe: tests/integration/runner/test_unpublished_guard.py)
    'delete from {table} where "MessageId" in (select "MessageId" from {table} '
    'where "Dispatched" = true and "DispatchedAt" < %(before)s limit 10000)'
)


def _nsb_queries(conn: psycopg.Connection[Any], zoo: ZooTable) -> None:
    """NServiceBus reads its outbox record by the incoming MessageId, marks it dispatched
    (boolean, time, operations emptied) and cleans dispatched records up by age."""
    table = sql.Identifier("public", zoo.settings["table"])

    def run(statement: str, **params: Any) -> psycopg.Cursor[Any]:
        return conn.execute(sql.SQL(statement).format(table=table), params)  # type: ignore[arg-type]

    # A record our relay published during the migration, as NServiceBus sees it.
    relayed = conn.execute(
        sql.SQL(
            'SELECT "MessageId" FROM {} WHERE "DispatchedAt" IS NOT NULL '
            "AND \"Operations\" <> '[]' LIMIT 1"
        ).format(table)
    ).fetchone()
    assert relayed is not None
    relayed_seen = run(NSB_GET, message_id=relayed[0]).fetchall()
    # plan's status-column-beside warning: the relay sets DispatchedAt only, so NServiceBus
    # still reads "not dispatched" and would dispatch the operations again on a retry
    assert [r[0] for r in relayed_seen] == [False]
    message_id = run(NSB_STORE, n=10**6).fetchone()[0]  # type: ignore[index]
    got = run(NSB_GET, message_id=message_id).fetchall()
    assert len(got) == 1 and got[0][0] is False and got[0][1][0]["Headers"] == {"n": "1000000"}
    assert run(NSB_SET_AS_DISPATCHED, message_id=message_id).rowcount == 1
    assert run(NSB_GET, message_id=message_id).fetchall() == [(True, [])]
    assert partition_of(conn, table, "MessageId", message_id) == "DEFAULT"
    # the cleanup deletes that dispatched record and nothing not yet dispatched
    pending = run(NSB_STORE, n=10**6 + 1).fetchone()[0]  # type: ignore[index]
    run(NSB_CLEANUP, before="infinity")
    assert run(NSB_GET, message_id=message_id).fetchall() == []
    assert [r[0] for r in run(NSB_GET, message_id=pending).fetchall()] == [False]
    # ... and its cleanup, which selects by "Dispatched", never deletes what the relay sent
    assert len(run(NSB_GET, message_id=relayed[0]).fetchall()) == 1


def _nsb_number(message: Message) -> int:
    return int(json.loads(message.payload)[0]["Body"]["n"])


def _nsb_header(message: Message, n: int) -> None:
    # NServiceBus keeps each outgoing message's headers inside Operations (the payload); the
    # table has no headers column. They arrive with the payload, untouched.
    operation = json.loads(message.payload)[0]
    assert operation["Headers"] == {"n": str(n)} and operation["MessageId"] == f"out-{n}"


NSERVICEBUS_LOAD = FrameworkUnderLoad(
    zoo=ZooTable(
        name="nservicebus",
        ddl=NSERVICEBUS.ddl,
        settings={
            **NSERVICEBUS.settings,
            "partitioned_table": "sales_outboxdata_new",
            "unpublished_partition": "sales_outboxdata_unpublished",
            "published_partition": "sales_outboxdata_published",
            # the primary key on MessageId is what makes two concurrent handlings of one
            # incoming message fail; accepted here (no MessageId is stored twice), the
            # alternative being a deduplication table written in the same transaction
            # (docs/patterns.md, "Unique keys the partitioned table cannot keep")
            "accept_lost_unique": ["sales_outboxdata_pkey"],
        },
        insert=NSB_STORE,
        header=("n", "{n}"),
        include_optional=True,
        original_name=True,
    ),
    source=NSERVICEBUS.source + " at commit 88b0f5101492; statements: src/SqlPersistence/"
    "Outbox/SqlDialect_PostgreSql.cs at commit 22b04183e16e (store, get, set-as-dispatched, "
    "cleanup)",
    answers=Answers(pause=False, keep_old_rows=True, immediate_access=True),
    why="every incoming message reads its outbox record: a dispatched record missing from "
    "the table for a while would have the message's operations dispatched again",
    number_of=_nsb_number,
    header_of=_nsb_header,
    framework_queries=_nsb_queries,
)

# -- django-jaiminho --------------------------------------------------------------------------

JAIMINHO_DDL = """
    CREATE TABLE "jaiminho_event" (
        "id" bigint NOT NULL PRIMARY KEY GENERATED BY DEFAULT AS IDENTITY,
        "created_at" timestamp with time zone NOT NULL,
        "sent_at" timestamp with time zone NULL,
        "function" bytea NULL, "kwargs" bytea NULL, "message" bytea NULL,
        "stream" varchar(100) NULL, "strategy" varchar(100) NULL,
        "function_signing_key" varchar(255) NULL, "kwargs_signing_key" varchar(255) NULL,
        "message_signing_key" varchar(255) NULL)
"""
"""The Event model after migrations 0001-0008, as Django (identity ids) creates it."""
PICKLE_PREFIX = "\\x8004"
"""dill/pickle protocol 4 starts with these two bytes: the body is not UTF-8, as in life."""
JAIMINHO_INSERT = (
    # Event.objects.create(...) as Django issues it
    'INSERT INTO {table} ("created_at", "sent_at", "function", "kwargs", "message", "stream", '
    '"strategy", "function_signing_key", "kwargs_signing_key", "message_signing_key") VALUES '
    f"(now(), NULL, '\\x8004'::bytea, NULL, '{PICKLE_PREFIX}'::bytea || "
    "convert_to(json_build_object('n', %(n)s)::text, 'UTF8'), 'orders', 'publish-on-commit', "
    'NULL, NULL, NULL) RETURNING {table}."id"'
)
JAIMINHO_UNSENT = (
    # EventRelayer.relay(stream="orders"): filter(sent_at__isnull=True, stream=...)
    'SELECT "id" FROM {table} WHERE ("sent_at" IS NULL AND "stream" = %(stream)s) '
    'ORDER BY "created_at" ASC'
)
JAIMINHO_MARK = (
    # Event.mark_as_sent(): sent_at = now, then save(), which writes every field
    'UPDATE {table} SET "created_at" = "created_at", "sent_at" = now(), "function" = '
    '"function", "kwargs" = "kwargs", "message" = "message", "stream" = "stream", '
    '"strategy" = "strategy" WHERE {table}."id" = %(id)s'
)
JAIMINHO_CLEANER = (
    # event_cleaner: filter(sent_at__isnull=False, sent_at__lt=threshold).delete()
    'DELETE FROM {table} WHERE ("sent_at" IS NOT NULL AND "sent_at" < %(threshold)s)'
)


def _jaiminho_queries(conn: psycopg.Connection[Any], zoo: ZooTable) -> None:
    """jaiminho's relay command reads unsent events of a stream in creation order and marks
    each sent; its cleaner deletes events sent before a threshold."""
    table = sql.Identifier(zoo.settings["table"])

    def run(statement: str, **params: Any) -> psycopg.Cursor[Any]:
        return conn.execute(sql.SQL(statement).format(table=table), params)  # type: ignore[arg-type]

    assert run(JAIMINHO_UNSENT, stream="orders").fetchall() == []
    new_id = run(JAIMINHO_INSERT, n=10**6).fetchone()[0]  # type: ignore[index]
    assert run(JAIMINHO_UNSENT, stream="orders").fetchall() == [(new_id,)]
    assert run(JAIMINHO_MARK, id=new_id).rowcount == 1
    assert run(JAIMINHO_UNSENT, stream="orders").fetchall() == []
    assert partition_of(conn, table, "id", new_id) == "DEFAULT"
    before = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()
    pending = run(JAIMINHO_INSERT, n=10**6 + 1).fetchone()[0]  # type: ignore[index]
    deleted = run(JAIMINHO_CLEANER, threshold="infinity").rowcount
    assert before is not None and deleted == before[0]  # every sent event, old rows included
    assert run(JAIMINHO_UNSENT, stream="orders").fetchall() == [(pending,)]


def _jaiminho_number(message: Message) -> int:
    body = message.payload_bytes
    assert body[:2] == b"\x80\x04", body[:8]  # the raw body went through untouched
    return int(json.loads(body[2:])["n"])


def _jaiminho_header(message: Message, n: int) -> None:
    assert message.headers().get("stream") == "orders", message


JAIMINHO_LOAD = FrameworkUnderLoad(
    zoo=ZooTable(
        name="django-jaiminho",
        ddl=JAIMINHO_DDL,
        settings={
            "table": "jaiminho_event",
            "partitioned_table": "jaiminho_event_new",
            "unpublished_partition": "jaiminho_event_unpublished",
            "published_partition": "jaiminho_event_published",
            "published_column": "sent_at",
            "payload_column": "message",
            "metadata_columns": "stream",
        },
        insert=JAIMINHO_INSERT,
        header=("stream", "orders"),
        include_optional=True,
        original_name=True,
    ),
    source="loadsmart/django-jaiminho, jaiminho/migrations/0001-0008 (the DDL; 0008 at "
    "commit 25e4a53da648); jaiminho/relayer.py at commit 0314e88f1cfe (read, mark_as_sent) "
    "and jaiminho/management/commands/event_cleaner.py at commit 411b088da4cc (cleanup)",
    answers=Answers(pause=False, keep_old_rows=True, immediate_access=False),
    why="the old sent events must join so that the cleaner still deletes them; nothing but "
    "the cleaner reads sent events, so a copy window is fine",
    number_of=_jaiminho_number,
    header_of=_jaiminho_header,
    framework_queries=_jaiminho_queries,
)

LOADS = [BRIGHTER_LOAD, NSERVICEBUS_LOAD, JAIMINHO_LOAD]


def check_framework_delivery(outcome: Outcome, framework: FrameworkUnderLoad) -> None:
    """Nothing lost, nothing delivered twice, every message with its framework's headers."""
    assert outcome.writer_errors == [], outcome.writer_errors[:3]
    assert outcome.violations == []
    assert outcome.unpublished_left == 0
    delivered = [str(m.id) for m in outcome.delivered]
    lost = sorted(set(map(str, outcome.written)) - set(delivered))
    assert lost == [], f"{len(lost)} lost, e.g. {lost[:5]}"
    twice = sorted({i for i in delivered if delivered.count(i) > 1})
    assert twice == [], f"{len(twice)} delivered twice, e.g. {twice[:5]}"
    assert outcome.final_rows == SEEDED_PUBLISHED + len(outcome.written)
    for message in outcome.delivered:
        framework.header_of(message, framework.number_of(message))


@pytest.mark.slow
@pytest.mark.pg_edges
@pytest.mark.parametrize("framework", LOADS, ids=[f.zoo.name for f in LOADS])
def test_framework_outbox_migrates_under_its_own_statements(
    dsn: str, framework: FrameworkUnderLoad
) -> None:
    pattern = recommend(framework.answers).pattern
    assert pattern in ("hoper", "hopia"), (framework.why, pattern)
    outcome, _ = migrate_under_load(dsn, framework.zoo, pattern)
    check_framework_delivery(outcome, framework)
    with psycopg.connect(dsn, autocommit=True) as conn:
        framework.framework_queries(conn, framework.zoo)


DELETE_ON_DELIVERY = [MASSTRANSIT, DEBEZIUM_EXAMPLE]


@pytest.mark.pg_edges
@pytest.mark.parametrize("table", DELETE_ON_DELIVERY, ids=[t.name for t in DELETE_ON_DELIVERY])
def test_a_delete_on_delivery_outbox_is_refused_before_anything_is_written(
    dsn: str, table: FrameworkTable
) -> None:
    """Nothing to migrate: the table holds only undelivered rows. `run` refuses with plan's
    own line, whichever pattern the wizard would pick, and writes nothing."""
    pattern = recommend(Answers(pause=False, keep_old_rows=True, immediate_access=False)).pattern
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(table.ddl)
        facts = introspect(conn, table.spec_settings().spec, pattern)
        assert [b.code for b in facts.blockers] == ["delete-on-delivery"], table.source
        with (
            Runner(dsn, table.spec_settings(), pattern) as runner,
            pytest.raises(SchemaError) as refused,
        ):
            runner.run("V2")
        assert "this outbox deletes delivered rows: there is nothing to partition" in str(
            refused.value
        )
        created = conn.execute("SELECT to_regnamespace('outbox_migrate')").fetchone()
        assert created == (None,)
