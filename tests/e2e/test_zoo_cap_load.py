"""DotNetCore.CAP's `cap.published` migrated under load, with CAP's own INSERT supplying its
snowflake ids (about 2·10^18), through HOP and HOPER and on to the original name (CAP's table
name is fixed by its configuration); then CAP's own retry read, state change and cleanup run on
the migrated table.

CAP makes every id itself (`SnowflakeId`): the column is a bare `bigint` primary key, so the
migration takes the ids as given (`id_kind = application`), and the deploy gates watch the
writers, not the ids. The primary key, which PostgreSQL cannot keep on a table partitioned by
"StatusName", is accepted as lost: snowflake ids do not collide, and nothing in CAP relies on
the key to refuse a duplicate message. The publication marker is CAP's "StatusName", given
explicitly ('Scheduled' until sent, 'Succeeded' after).

The DDL and statements are CAP's PostgreSQL storage (src/DotNetCore.CAP.PostgreSql,
`IStorageInitializer.PostgreSql.cs` for the published table and its indexes,
`IDataStorage.PostgreSql.cs` for StoreMessageAsync, the state change, the retry read and
DeleteExpiresAsync). Values CAP binds (the snowflake id, the time, the serialized message) are
produced by the server here: the id from the clock's milliseconds since the Twitter epoch
shifted by 22 bits, with the writer's sequence number in the low bits, so every id is unique
and about 2·10^18.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_migrate.advisory.introspect import introspect
from tests.support.zoo import Outcome, ZooTable, migrate_under_load

CAP_DDL = """
    CREATE SCHEMA IF NOT EXISTS "cap";
    CREATE TABLE IF NOT EXISTS "cap"."published"(
        "Id" BIGINT PRIMARY KEY NOT NULL,
        "Version" VARCHAR(20) NOT NULL,
        "Name" VARCHAR(200) NOT NULL,
        "Content" TEXT NULL,
        "Retries" INT NOT NULL,
        "Added" TIMESTAMP NOT NULL,
        "ExpiresAt" TIMESTAMP NULL,
        "StatusName" VARCHAR(50) NOT NULL
    );
    CREATE INDEX IF NOT EXISTS "idx_published_ExpiresAt_StatusName"
        ON "cap"."published"("ExpiresAt","StatusName");
    CREATE INDEX IF NOT EXISTS "idx_published_Version_ExpiresAt_StatusName"
        ON "cap"."published" ("Version","ExpiresAt","StatusName");
"""
SNOWFLAKE_ID = (
    "((floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint - 1288834974657) << 22) "
    "| %(n)s::bigint"
)
CAP_STORE = (
    # StoreMessageAsync (Version 'v1'; Content is the serialized message, headers and value)
    'INSERT INTO {table} ("Id","Version","Name","Content","Retries","Added","ExpiresAt",'
    f"\"StatusName\")VALUES({SNOWFLAKE_ID},'v1','orders',"
    "json_build_object('Headers', json_build_object('cap-msg-name', 'orders', 'n', "
    "%(n)s::text), 'Value', json_build_object('n', %(n)s))::text,0,"
    "(now() AT TIME ZONE 'UTC'),NULL,'Scheduled') RETURNING \"Id\""
)
CAP_NEED_RETRY = (
    # _GetMessagesOfNeedRetryAsync on the published table
    'SELECT "Id","Content","Retries","Added" FROM {table} WHERE "Retries"<%(retries)s '
    'AND "Version"=%(version)s AND "Added"<%(added)s AND "StatusName" IN '
    "('Failed','Scheduled') LIMIT 200;"
)
CAP_CHANGE_STATE = (
    # _ChangeMessageStateAsync: CAP's own dispatcher marking a message sent
    'UPDATE {table} SET "Content"=%(content)s,"Retries"=%(retries)s,"ExpiresAt"=%(expires)s,'
    '"StatusName"=%(status)s WHERE "Id"=%(id)s'
)
CAP_DELETE_EXPIRES = (
    # DeleteExpiresAsync
    'DELETE FROM {table} WHERE "Id" IN (SELECT "Id" FROM {table} WHERE "ExpiresAt" < '
    "%(timeout)s AND \"StatusName\" IN ('Succeeded','Failed') LIMIT %(batch)s)"
)
SNOWFLAKE_FLOOR = 10**18
"""Every id this test writes is above this: the application's, not a sequence's."""

CAP = ZooTable(
    name="dotnetcore-cap",
    ddl=CAP_DDL,
    settings={
        "schema": "cap",
        "table": "published",
        "id_column": "Id",
        "id_kind": "application",
        "published_column": "StatusName",
        "unpublished_value": "Scheduled",
        "published_value": "Succeeded",
        "payload_column": "Content",
        "created_column": "Added",
        "event_type_column": "Name",
        "partitioned_table": "published_new",
        "unpublished_partition": "published_unpublished",
        "published_partition": "published_published",
        "accept_lost_unique": ["published_pkey"],
    },
    insert=CAP_STORE,
    header=("n", "{n}"),
    include_optional=True,
    original_name=True,
)


def _cap_queries(conn: psycopg.Connection[Any]) -> None:
    """CAP on the migrated table, under its own name: a new message with its own id, the
    retry read that finds it (and nothing our relay sent), CAP's own state change, which
    moves it to the published partition, and the cleanup of expired sent messages only."""
    table = sql.Identifier("cap", "published")

    def run(statement: str, **params: Any) -> psycopg.Cursor[Any]:
        return conn.execute(sql.SQL(statement).format(table=table), params)  # type: ignore[arg-type]

    need_retry = {"retries": 50, "version": "v1", "added": "infinity"}
    assert run(CAP_NEED_RETRY, **need_retry).fetchall() == []  # our relay sent everything
    sent = run(CAP_STORE, n=4_000_000).fetchone()[0]  # type: ignore[index]
    pending = run(CAP_STORE, n=4_000_001).fetchone()[0]  # type: ignore[index]
    assert sent > SNOWFLAKE_FLOOR and pending > SNOWFLAKE_FLOOR
    assert sorted(r[0] for r in run(CAP_NEED_RETRY, **need_retry)) == sorted([sent, pending])
    changed = run(CAP_CHANGE_STATE, content="{}", retries=0, expires="-infinity",
                  status="Succeeded", id=sent)  # fmt: skip
    assert changed.rowcount == 1
    where = conn.execute(
        sql.SQL('SELECT tableoid::regclass::text FROM {} WHERE "Id" = %s').format(table), (sent,)
    ).fetchone()
    assert where is not None and where[0] != "cap.published_unpublished"
    assert [r[0] for r in run(CAP_NEED_RETRY, **need_retry)] == [pending]
    assert run(CAP_DELETE_EXPIRES, timeout="now", batch=1000).rowcount == 1
    left = conn.execute(
        sql.SQL('SELECT count(*) FROM {} WHERE "Id" = ANY(%s)').format(table), ([sent, pending],)
    ).fetchone()
    assert left == (1,)


def _check(outcome: Outcome) -> None:
    """Nothing lost, nothing twice, every message as CAP wrote it, every id CAP's."""
    assert outcome.writer_errors == [], outcome.writer_errors[:3]
    assert outcome.violations == []
    assert outcome.unpublished_left == 0
    assert outcome.written and all(int(i) > SNOWFLAKE_FLOOR for i in outcome.written)
    delivered = [str(m.id) for m in outcome.delivered]
    lost = sorted(set(map(str, outcome.written)) - set(delivered))
    assert lost == [], f"{len(lost)} lost, e.g. {lost[:5]}"
    twice = sorted({i for i in delivered if delivered.count(i) > 1})
    assert twice == [], f"{len(twice)} delivered twice, e.g. {twice[:5]}"
    for message in outcome.delivered:
        content = json.loads(message.payload)
        assert content["Headers"]["n"] == str(content["Value"]["n"]), message


@pytest.mark.newest_pg_only
def test_plan_takes_caps_snowflake_ids_as_application_ids(dsn: str) -> None:
    """Without a setting plan says what to set; with `id_kind = application` nothing about the
    id blocks, and it says the gates watch the writers. The alternative it prints (a sequence
    default, for a team that would rather have the database make the ids) runs as printed on
    CAP's mixed-case column in its own schema, and then plan takes the id as a database id."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(CAP_DDL)
        facts = introspect(conn, CAP.spec_settings().spec, "hoper")
        assert not [b for b in facts.blockers if b.code.startswith("id-")], facts.blockers
        assert facts.id_kind(CAP.spec_settings().spec) == "application"  # not "none"
        (note,) = [n for n in facts.notes if n.code == "id-application"]
        assert "published_gate_seq" in note.remedy
        database = CAP.spec_settings(id_kind="database").spec
        (no_generator,) = [
            b for b in introspect(conn, database, "hoper").blockers if b.code == "id-no-generator"
        ]
        assert 'set id_kind = "application"' in no_generator.remedy
        conn.execute(no_generator.remedy.split("from now on: ", 1)[1])
        facts = introspect(conn, database, "hoper")
        assert not [b for b in facts.blockers if b.code.startswith("id-")], facts.blockers
        assert facts.id_kind(database) == "sequence"
        assert facts.sequence == 'cap."published_Id_seq"', facts.sequence


@pytest.mark.slow
@pytest.mark.pg_edges
@pytest.mark.parametrize("pattern", ["hop", "hoper"])
def test_cap_migrates_under_load_with_its_own_snowflake_ids(dsn: str, pattern: str) -> None:
    outcome, _ = migrate_under_load(dsn, CAP, pattern)
    _check(outcome)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _cap_queries(conn)
