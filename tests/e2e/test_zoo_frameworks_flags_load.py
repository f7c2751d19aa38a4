"""The frameworks' wing of the schema zoo under load, flag and status markers: eventuate-tram's
`message` (`published smallint`), django-outbox-pattern's `published` (an integer status),
Spring Modulith's `event_publication` v2 (`status` beside `completion_date`) and NServiceBus
with its `Dispatched` boolean kept in step by the relay. Played as in
`test_zoo_frameworks_load.py`: the framework's own INSERT while our relay publishes through the
pattern `wizard` recommends, then the framework's own read, mark and cleanup statements on the
migrated table, which has the framework's table name again.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_migrate.relay.message import Message
from outbox_migrate.wizard import Answers, recommend
from tests.e2e.test_zoo_frameworks import SPRING_MODULITH
from tests.e2e.test_zoo_frameworks_load import (
    NSB_GET,
    NSB_STORE,
    NSERVICEBUS_LOAD,
    FrameworkUnderLoad,
    check_framework_delivery,
    partition_of,
)
from tests.support.zoo import ZooTable, migrate_under_load


def _runner(conn: psycopg.Connection[Any], table: sql.Composable) -> Any:
    def run(statement: str, **params: Any) -> psycopg.Cursor[Any]:
        return conn.execute(sql.SQL(statement).format(table=table), params)  # type: ignore[arg-type]

    return run


# -- eventuate-tram ---------------------------------------------------------------------------

EVENTUATE_DDL = """
    CREATE TABLE message (
        id VARCHAR(1000) PRIMARY KEY, destination TEXT NOT NULL, headers TEXT NOT NULL,
        payload TEXT NOT NULL, published SMALLINT DEFAULT 0, message_partition SMALLINT,
        creation_time BIGINT);
    ALTER TABLE message ALTER COLUMN published SET NOT NULL
"""
"""eventuate-foundation/eventuate-common, postgres/2.initialize-database.sql (`eventuate.message`,
here in the public schema), and the step plan asks for first: the flag made NOT NULL (its
inserts never leave it NULL)."""
EVENTUATE_INSERT = (
    # EventuateJdbcUtils.createInsertIntoMessageTableSql with the PostgreSQL dialect's
    # current-time-in-milliseconds expression; the id as eventuate's IdGenerator makes it
    # (hex time, then a counter: they sort by time), here the sequence number zero-padded
    "insert into {table}(id, destination, headers, payload, creation_time) values("
    "lpad(to_hex(%(n)s::bigint), 16, '0') || '-0000000000000001', 'orders', "
    "json_build_object('ID', lpad(to_hex(%(n)s::bigint), 16, '0'), 'DESTINATION', 'orders', "
    "'n', %(n)s::text)::text, json_build_object('n', %(n)s)::text, "
    "(ROUND(EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000))) RETURNING id"
)
EVENTUATE_POLL = "SELECT * FROM {table} WHERE published = 0 ORDER BY id ASC LIMIT 100"
"""eventuate-cdc's polling reader (PollingDao): unpublished rows in id order."""
EVENTUATE_MARK = "UPDATE {table} SET published = 1 WHERE id in (%(id)s)"


def _eventuate_queries(conn: psycopg.Connection[Any], zoo: ZooTable) -> None:
    """eventuate's polling CDC reads `published = 0` in id order and sets 1 on what it sent."""
    table = sql.Identifier(zoo.settings["table"])
    run = _runner(conn, table)
    assert run(EVENTUATE_POLL).fetchall() == []  # our relay set published = 1 on every row
    new_id = run(EVENTUATE_INSERT, n=10**6).fetchone()[0]
    assert [r[0] for r in run(EVENTUATE_POLL).fetchall()] == [new_id]
    assert run(EVENTUATE_MARK, id=new_id).rowcount == 1
    assert run(EVENTUATE_POLL).fetchall() == []
    assert partition_of(conn, table, "id", new_id) == "DEFAULT"


def _eventuate_header(message: Message, n: int) -> None:
    headers = message.headers()
    assert (headers.get("n"), headers.get("DESTINATION")) == (str(n), "orders"), message


EVENTUATE_LOAD = FrameworkUnderLoad(
    zoo=ZooTable(
        name="eventuate-tram",
        ddl=EVENTUATE_DDL,
        settings={
            "table": "message",
            "partitioned_table": "message_new",
            "unpublished_partition": "message_unpublished",
            "published_partition": "message_published",
            "published_column": "published",
            "id_kind": "application",
            "created_column": "",  # creation_time is epoch milliseconds in a bigint
            # the headers column is TEXT holding a JSON object, parsed per row by the relay
            "headers_column": "headers",
            # eventuate's ids are made unique by its IdGenerator, not by the database
            "accept_lost_unique": ["message_pkey"],
        },
        insert=EVENTUATE_INSERT,
        header=("n", "{n}"),
        include_optional=True,
        original_name=True,
    ),
    source="eventuate-foundation/eventuate-common postgres/2.initialize-database.sql (DDL, "
    "as field-flags' test_zoo_flags.py has it), EventuateJdbcUtils."
    "createInsertIntoMessageTableSql (INSERT); eventuate-cdc PollingDao (read and mark); "
    "as read on their default branches, no release pinned",
    answers=Answers(pause=False, keep_old_rows=True, immediate_access=False),
    why="the CDC service tails the table and reads only unpublished rows: published ones may "
    "join later",
    number_of=lambda m: int(json.loads(m.payload)["n"]),
    header_of=_eventuate_header,
    framework_queries=_eventuate_queries,
)

# -- django-outbox-pattern --------------------------------------------------------------------

OUTBOX_PATTERN_DDL = """
    CREATE TABLE "published" (
        "id" uuid NOT NULL PRIMARY KEY, "version" varchar(100) NULL,
        "destination" varchar(255) NOT NULL, "body" jsonb NOT NULL,
        "added" timestamp with time zone NOT NULL,
        "expires_at" timestamp with time zone NOT NULL,
        "retry" integer NOT NULL CHECK ("retry" >= 0), "status" integer NOT NULL,
        "headers" jsonb NOT NULL);
    CREATE INDEX "published_status_27c9ec_btree" ON "published" USING btree ("status");
    CREATE INDEX "published_added_idx" ON "published" ("added")
"""
"""The Published model (db_table "published") after migrations 0001-0007 as Django creates it:
the defaults (status SCHEDULE = 1, headers {}) are Python-side, so the column has no DEFAULT."""
OUTBOX_PATTERN_INSERT = (
    # Published.objects.create(...) as Django issues it; save() fills headers
    'INSERT INTO {table} ("id", "version", "destination", "body", "added", "expires_at", '
    '"retry", "status", "headers") VALUES (gen_random_uuid(), \'v1\', \'/topic/orders.v1\', '
    "jsonb_build_object('n', %(n)s), now(), now() + interval '1 day', 0, 1, "
    "jsonb_build_object('dop-msg-id', 'm' || %(n)s, 'dop-msg-destination', "
    "'/topic/orders.v1')) RETURNING \"id\""
)
OUTBOX_PATTERN_SCHEDULED = (
    # the publish command: filter(status=SCHEDULE, expires_at__gte=now)
    'SELECT "id" FROM {table} WHERE ("expires_at" >= now() AND "status" = 1)'
)
OUTBOX_PATTERN_MARK = (
    # message.retry = attempts; message.status = SUCCEEDED; message.save()
    'UPDATE {table} SET "version" = "version", "destination" = "destination", "body" = '
    '"body", "added" = "added", "expires_at" = "expires_at", "retry" = 1, "status" = 2, '
    '"headers" = "headers" WHERE {table}."id" = %(id)s'
)
OUTBOX_PATTERN_PURGE = (
    # the purge command: added <= now - days, status in (SUCCEEDED, FAILED), by pk
    'DELETE FROM {table} WHERE "id" IN (SELECT "id" FROM {table} WHERE ("added" <= '
    '%(before)s AND "status" IN (2, -1)) LIMIT 500)'
)


def _outbox_pattern_queries(conn: psycopg.Connection[Any], zoo: ZooTable) -> None:
    """The publish command reads scheduled messages and saves each as SUCCEEDED; the purge
    command deletes succeeded and failed messages by age."""
    table = sql.Identifier(zoo.settings["table"])
    run = _runner(conn, table)
    assert run(OUTBOX_PATTERN_SCHEDULED).fetchall() == []  # our relay set status 2
    new_id = run(OUTBOX_PATTERN_INSERT, n=10**6).fetchone()[0]
    assert run(OUTBOX_PATTERN_SCHEDULED).fetchall() == [(new_id,)]
    assert run(OUTBOX_PATTERN_MARK, id=new_id).rowcount == 1
    assert run(OUTBOX_PATTERN_SCHEDULED).fetchall() == []
    assert partition_of(conn, table, "id", new_id) == "DEFAULT"
    pending = run(OUTBOX_PATTERN_INSERT, n=10**6 + 1).fetchone()[0]
    while run(OUTBOX_PATTERN_PURGE, before="infinity").rowcount:
        pass
    left = conn.execute(sql.SQL('SELECT "id" FROM {}').format(table)).fetchall()
    assert left == [(pending,)]  # every sent message purged, the scheduled one kept


def _outbox_pattern_header(message: Message, n: int) -> None:
    headers = message.headers()
    assert headers.get("dop-msg-id") == f"m{n}", message


OUTBOX_PATTERN_LOAD = FrameworkUnderLoad(
    zoo=ZooTable(
        name="django-outbox-pattern",
        ddl=OUTBOX_PATTERN_DDL,
        settings={
            "table": "published",
            "partitioned_table": "published_new",
            "unpublished_partition": "published_scheduled",
            "published_partition": "published_done",
            "published_column": "status",
            "unpublished_value": "1",  # SCHEDULE; the column has no DEFAULT to read it from
            "published_value": "2",  # SUCCEEDED
            "id_kind": "application",
            "order_column": "added",
            "created_column": "added",
            "payload_column": "body",
            "headers_column": "headers",
            "accept_lost_unique": ["published_pkey"],
        },
        insert=OUTBOX_PATTERN_INSERT,
        header=("dop-msg-id", "m{n}"),
        include_optional=True,
        original_name=True,
    ),
    source="juntossomosmais/django-outbox-pattern, django_outbox_pattern/models.py at commit "
    "118612ecbc70, choices.py and migrations/0001-0007 (DDL); management/commands/publish.py "
    "at commit 118612ecbc70 (read, mark) and purge.py at commit 2d1be4b812fa (cleanup)",
    answers=Answers(pause=False, keep_old_rows=True, immediate_access=False),
    why="purge must still find the old sent messages; nothing else reads them",
    number_of=lambda m: int(json.loads(m.payload)["n"]),
    header_of=_outbox_pattern_header,
    framework_queries=_outbox_pattern_queries,
)

# -- Spring Modulith v2 -----------------------------------------------------------------------

MODULITH_INSERT = (
    # JdbcEventPublicationRepositoryV2.SQL_STATEMENT_INSERT; status as created: PUBLISHED
    "INSERT INTO {table} (ID, EVENT_TYPE, LISTENER_ID, PUBLICATION_DATE, SERIALIZED_EVENT, "
    "STATUS, COMPLETION_ATTEMPTS, LAST_RESUBMISSION_DATE) VALUES (gen_random_uuid(), "
    "'com.example.OrderCompleted', 'com.example.Listener.on(OrderCompleted)', now(), "
    "json_build_object('n', %(n)s)::text, 'PUBLISHED', 1, now()) RETURNING ID"
)
MODULITH_INCOMPLETE = (
    # SQL_STATEMENT_FIND_INCOMPLETE (its columns list shortened to the id)
    "SELECT ID FROM {table} WHERE COMPLETION_DATE IS NULL OR STATUS != 'COMPLETED' "
    "ORDER BY PUBLICATION_DATE ASC"
)
MODULITH_COMPLETE = (
    "UPDATE {table} SET STATUS = 'COMPLETED', COMPLETION_DATE = now() WHERE ID = %(id)s"
)
MODULITH_DELETE_COMPLETED_BEFORE = (
    "DELETE FROM {table} WHERE COMPLETION_DATE < %(before)s AND (STATUS = 'COMPLETED' OR "
    "STATUS IS NULL)"
)


def _modulith_queries(conn: psycopg.Connection[Any], zoo: ZooTable) -> None:
    """Spring Modulith resubmits what `findIncompletePublications` returns, completes by id
    (status and date together) and deletes completed publications by age."""
    table = sql.Identifier(zoo.settings["table"])
    run = _runner(conn, table)
    # the relay set the status beside the date: nothing published looks incomplete
    assert run(MODULITH_INCOMPLETE).fetchall() == []
    new_id = run(MODULITH_INSERT, n=10**6).fetchone()[0]
    assert run(MODULITH_INCOMPLETE).fetchall() == [(new_id,)]
    assert run(MODULITH_COMPLETE, id=new_id).rowcount == 1
    assert run(MODULITH_INCOMPLETE).fetchall() == []
    assert partition_of(conn, table, "id", new_id) == "DEFAULT"
    pending = run(MODULITH_INSERT, n=10**6 + 1).fetchone()[0]
    run(MODULITH_DELETE_COMPLETED_BEFORE, before="infinity")
    left = conn.execute(sql.SQL("SELECT ID FROM {}").format(table)).fetchall()
    assert left == [(pending,)]


def _modulith_header(message: Message, n: int) -> None:
    assert message.headers().get("event_type") == "com.example.OrderCompleted", message


MODULITH_LOAD = FrameworkUnderLoad(
    zoo=ZooTable(
        name="spring-modulith-v2",
        ddl=SPRING_MODULITH.ddl,
        settings={
            **SPRING_MODULITH.settings,
            "partitioned_table": "event_publication_new",
            "unpublished_partition": "event_publication_incomplete",
            "published_partition": "event_publication_completed",
            "status_column": "status",
            "status_published_value": "COMPLETED",
            "metadata_columns": "event_type",
        },
        insert=MODULITH_INSERT,
        header=("event_type", "com.example.OrderCompleted"),
        include_optional=True,
        original_name=True,
    ),
    source=SPRING_MODULITH.source + "; statements: spring-modulith-events-jdbc/.../"
    "JdbcEventPublicationRepositoryV2.java at commit 0a327e248fe8 (insert, find incomplete, "
    "complete by id, delete completed before)",
    answers=Answers(pause=False, keep_old_rows=True, immediate_access=True),
    why="the event publication registry lists completed publications at any time "
    "(findCompletedPublications): they must stay readable",
    number_of=lambda m: int(json.loads(m.payload)["n"]),
    header_of=_modulith_header,
    framework_queries=_modulith_queries,
)

# -- NServiceBus, its Dispatched boolean kept in step -----------------------------------------


def _nsb_status_queries(conn: psycopg.Connection[Any], zoo: ZooTable) -> None:
    """With `status_column = "Dispatched"` the relay sets the boolean beside DispatchedAt, so
    NServiceBus's get sees a record the relay published as dispatched, and its cleanup
    deletes it."""
    table = sql.Identifier("public", zoo.settings["table"])
    run = _runner(conn, table)
    relayed = conn.execute(
        sql.SQL('SELECT "MessageId" FROM {} WHERE "DispatchedAt" IS NOT NULL LIMIT 1').format(table)
    ).fetchone()
    assert relayed is not None
    assert [r[0] for r in run(NSB_GET, message_id=relayed[0]).fetchall()] == [True]
    pending = run(NSB_STORE, n=10**6).fetchone()[0]
    run(
        'delete from {table} where "MessageId" in (select "MessageId" from {table} where '
        '"Dispatched" = true and "DispatchedAt" < %(before)s limit 100000)',
        before="infinity",
    )
    left = conn.execute(sql.SQL('SELECT "MessageId" FROM {}').format(table)).fetchall()
    assert left == [(pending,)]


NSERVICEBUS_STATUS_LOAD = dataclasses.replace(
    NSERVICEBUS_LOAD,
    zoo=dataclasses.replace(
        NSERVICEBUS_LOAD.zoo,
        name="nservicebus-dispatched",
        settings={
            **NSERVICEBUS_LOAD.zoo.settings,
            "status_column": "Dispatched",
            "status_published_value": "true",
        },
    ),
    framework_queries=_nsb_status_queries,
)

LOADS = [EVENTUATE_LOAD, OUTBOX_PATTERN_LOAD, MODULITH_LOAD, NSERVICEBUS_STATUS_LOAD]


@pytest.mark.slow
@pytest.mark.pg_edges
@pytest.mark.parametrize("framework", LOADS, ids=[f.zoo.name for f in LOADS])
def test_flag_framework_outbox_migrates_under_its_own_statements(
    dsn: str, framework: FrameworkUnderLoad
) -> None:
    pattern = recommend(framework.answers).pattern
    assert pattern in ("hoper", "hopia"), (framework.why, pattern)
    outcome, _ = migrate_under_load(dsn, framework.zoo, pattern)
    check_framework_delivery(outcome, framework)
    with psycopg.connect(dsn, autocommit=True) as conn:
        framework.framework_queries(conn, framework.zoo)
