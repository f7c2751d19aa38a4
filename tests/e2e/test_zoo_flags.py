"""The schema zoo, flags' wing: outboxes whose publication marker is a flag or a status, not a
timestamp, through `plan` and HOPER/HOPIA under live writers and relays; and a status column
the relay keeps in step beside the timestamp (Spring Modulith v2).

Before, every one of them was refused by `plan` ("published is smallint, not a timestamp"),
and a status beside the timestamp kept the value the application wrote.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from outbox_migrate.advisory.introspect import introspect
from outbox_migrate.advisory.lost_semantics import LAYOUT_WARNINGS
from outbox_migrate.cli.watch import _backlog as watch_backlog
from outbox_migrate.config import load_settings
from outbox_migrate.jobs.maintain import MaintenanceOptions, maintain_once
from outbox_migrate.patterns.conditions import marker_kind
from outbox_migrate.patterns.names import Names
from outbox_migrate.rehearse.scratch import fill_synthetic, rebuild
from outbox_migrate.rehearse.source import read_shape
from outbox_migrate.relay.options import Mode, RelayOptions
from outbox_migrate.relay.worker import Relay
from tests.support.cli import error_line, run_cli
from tests.support.zoo import Collector, ZooTable, check_delivery, migrate_under_load

EVENTUATE_DDL = """
    CREATE TABLE message (
        id VARCHAR(1000) PRIMARY KEY,
        destination TEXT NOT NULL,
        headers TEXT NOT NULL,
        payload TEXT NOT NULL,
        published SMALLINT DEFAULT 0,
        message_partition SMALLINT,
        creation_time BIGINT)
"""
"""eventuate-tram's outbox as published: eventuate-foundation/eventuate-common,
postgres/2.initialize-database.sql (`eventuate.message`; `message_partition` from its later
versions), in the public schema."""

EVENTUATE = ZooTable(
    name="eventuate-tram",
    # The flag may be NULL as published (refused by plan, see below): the operator makes it
    # NOT NULL first, as plan's remedy says; eventuate's inserts never leave it NULL.
    ddl=EVENTUATE_DDL + "; ALTER TABLE message ALTER COLUMN published SET NOT NULL",
    settings={
        "table": "message",
        "partitioned_table": "message_new",
        "unpublished_partition": "message_unpublished",
        "published_partition": "message_published",
        "published_column": "published",
        "id_kind": "application",
        "created_column": "",  # creation_time is epoch milliseconds in a bigint
        "metadata_columns": "destination",
        # the application supplies the ids; only the primary key refused a duplicate
        "accept_lost_unique": "message_pkey",
    },
    # ids as eventuate makes them: they sort by time (here a zero-padded sequence number)
    insert="INSERT INTO {table} (id, destination, headers, payload, creation_time) VALUES "
    "(lpad(%(n)s::text, 16, '0') || '-0000000000000001', 'dest-' || %(n)s, "
    "json_build_object('ID', lpad(%(n)s::text, 16, '0'), 'DESTINATION', 'dest-' || %(n)s, "
    "'PARTITION_ID', 'p' || %(n)s %% 4)::text, json_build_object('n', %(n)s)::text, "
    "(extract(epoch FROM clock_timestamp()) * 1000)::bigint) RETURNING id",
    header=("destination", "dest-{n}"),
)

SENT_FLAG = ZooTable(
    name="sent-boolean",
    ddl="""
        CREATE TABLE outbox_sent (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, topic text NOT NULL,
            payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
            sent boolean NOT NULL DEFAULT false);
        CREATE INDEX outbox_sent_pending ON outbox_sent (id) WHERE NOT sent
    """,
    settings={
        "table": "outbox_sent",
        "partitioned_table": "outbox_sent_new",
        "unpublished_partition": "outbox_sent_unpublished",
        "published_partition": "outbox_sent_published",
        "published_column": "sent",
        "metadata_columns": "topic",
    },
    insert="INSERT INTO {table} (topic, payload) "
    "VALUES ('topic-' || %(n)s, jsonb_build_object('n', %(n)s)) RETURNING id",
    header=("topic", "topic-{n}"),
)

STATUS_ENUM = ZooTable(
    name="status-enum",
    ddl="""
        CREATE TYPE outbox_state AS ENUM ('PENDING', 'PUBLISHED', 'FAILED');
        CREATE TABLE outbox_st (
            id bigserial PRIMARY KEY, message_key text, payload json NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now(),
            state outbox_state NOT NULL DEFAULT 'PENDING', trace_id text)
    """,
    settings={
        "table": "outbox_st",
        "partitioned_table": "outbox_st_new",
        "unpublished_partition": "outbox_st_unpublished",
        "published_partition": "outbox_st_published",
        "published_column": "state",
        "published_value": "PUBLISHED",  # unpublished: its DEFAULT, PENDING
        "metadata_columns": "trace_id",
    },
    insert="INSERT INTO {table} (message_key, payload, trace_id) "
    "VALUES ('k' || %(n)s %% 5, json_build_object('n', %(n)s), 't' || %(n)s) RETURNING id",
    header=("trace_id", "t{n}"),
)

MODULITH_DDL = """
    CREATE TABLE event_publication (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, listener_id text NOT NULL,
        serialized_event text NOT NULL,
        publication_date timestamptz NOT NULL DEFAULT now(),
        completion_date timestamptz, status text NOT NULL DEFAULT 'PUBLISHED',
        completion_attempts int)
"""
"""Spring Modulith v2's `event_publication` (spring-projects/spring-modulith,
spring-modulith-events-jdbc schemas/v2/schema-postgresql.sql): status beside completion_date;
a bigint identity here instead of its random uuid, so the run needs no order column."""

STATUS_BESIDE = ZooTable(
    name="status-beside-timestamp",
    ddl=MODULITH_DDL,
    settings={
        "table": "event_publication",
        "partitioned_table": "event_publication_new",
        "unpublished_partition": "event_publication_unpublished",
        "published_partition": "event_publication_published",
        "published_column": "completion_date",
        "created_column": "publication_date",
        "payload_column": "serialized_event",
        "metadata_columns": "listener_id",
        "status_column": "status",
        "status_published_value": "COMPLETED",
    },
    insert="INSERT INTO {table} (listener_id, serialized_event) "
    "VALUES ('listener-' || %(n)s, json_build_object('n', %(n)s)::text) RETURNING id",
    header=("listener_id", "listener-{n}"),
)

FLAGS = [EVENTUATE, SENT_FLAG, STATUS_ENUM, STATUS_BESIDE]
RUNS = [(EVENTUATE, "hoper"), (SENT_FLAG, "hoper"), (SENT_FLAG, "hopia"),
        (STATUS_ENUM, "hoper"), (STATUS_BESIDE, "hoper")]  # fmt: skip


@pytest.mark.slow
@pytest.mark.pg_edges
@pytest.mark.parametrize(("zoo", "pattern"), RUNS, ids=[f"{z.name}-{p}" for z, p in RUNS])
def test_a_flag_outbox_migrates_under_load(dsn: str, zoo: ZooTable, pattern: str) -> None:
    outcome, _ = migrate_under_load(dsn, zoo, pattern)
    check_delivery(outcome, zoo)
    spec = zoo.spec_settings().spec
    with psycopg.connect(dsn, autocommit=True) as conn:
        bound = conn.execute(
            "SELECT pg_get_expr(relpartbound, oid) FROM pg_class WHERE relname = %s",
            (spec.unpublished_partition,),
        ).fetchone()
        states = conn.execute(
            f"SELECT {'status' if zoo is STATUS_BESIDE else spec.published_column}::text, "
            f"count(*) FROM {spec.partitioned_table} GROUP BY 1"
        ).fetchall()
    expected_bound = {EVENTUATE.name: "FOR VALUES IN ('0')",
                      SENT_FLAG.name: "FOR VALUES IN (false)",
                      STATUS_ENUM.name: "FOR VALUES IN ('PENDING')",
                      STATUS_BESIDE.name: "FOR VALUES IN (NULL)"}  # fmt: skip
    assert bound == (expected_bound[zoo.name],)
    published = {EVENTUATE.name: "1", SENT_FLAG.name: "true", STATUS_ENUM.name: "PUBLISHED",
                 STATUS_BESIDE.name: "COMPLETED"}  # fmt: skip
    # every row is published, and the relay set the status beside the timestamp too
    assert [s for s, _ in states] == [published[zoo.name]]
    if zoo is EVENTUATE:
        for message in outcome.delivered:
            n = json.loads(message.payload)["n"]
            # eventuate's own headers, text holding a JSON object, reach the broker
            assert message.headers().get("DESTINATION") == f"dest-{n}"
            assert message.headers().get("PARTITION_ID") == f"p{n % 4}"


@pytest.mark.parametrize("zoo", FLAGS, ids=[z.name for z in FLAGS])
def test_a_flag_outbox_plans_without_blockers(dsn: str, zoo: ZooTable) -> None:
    settings = zoo.spec_settings()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(zoo.ddl)
        facts = introspect(conn, settings.spec, "hoper")
        unset = zoo.spec_settings(status_column="", status_published_value="").spec
        without = introspect(conn, unset, "hoper")
    assert facts.blockers == []
    flag_notes = [n.message for n in facts.notes if n.code == "flag-marker"]
    if zoo is STATUS_BESIDE:
        assert flag_notes == []
        assert "status-column-beside" not in [w.code for w in facts.warnings]
        # without the setting the warning says it
        beside = next(w for w in without.warnings if w.code == "status-column-beside")
        assert 'status_column = "status" and status_published_value' in beside.remedy
        return
    expected = {EVENTUATE.name: "message.published is a flag: published = 0 is unpublished, the "
                "relay sets 1",
                SENT_FLAG.name: "outbox_sent.sent is a flag: sent = false is unpublished, the relay "
                "sets true",
                STATUS_ENUM.name: "outbox_st.state is a flag: state = PENDING is unpublished, the "
                "relay sets PUBLISHED"}  # fmt: skip
    assert flag_notes == [expected[zoo.name]]
    assert [w.code for w in facts.warnings][-len(LAYOUT_WARNINGS) :] == list(LAYOUT_WARNINGS)


@pytest.mark.newest_pg_only
def test_eventuates_nullable_flag_is_refused_with_the_recipe(dsn: str) -> None:
    """As published, `published` may be NULL: such a row would sit in the DEFAULT (published)
    partition and never be relayed."""
    settings = EVENTUATE.spec_settings()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EVENTUATE_DDL)
        facts = introspect(conn, settings.spec, "hoper")
    assert [b.code for b in facts.blockers] == ["published-flag-nullable"]
    assert (
        'ALTER TABLE "public"."message" ALTER COLUMN "published" SET NOT NULL'
        in facts.blockers[0].remedy
    )


@pytest.mark.newest_pg_only
def test_a_status_value_the_column_cannot_hold_is_a_blocker(dsn: str) -> None:
    settings = STATUS_ENUM.spec_settings(published_value="SENT")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(STATUS_ENUM.ddl)
        facts = introspect(conn, settings.spec, "hoper")
        no_value = introspect(conn, STATUS_ENUM.spec_settings(published_value="").spec)
    assert [b.code for b in facts.blockers] == ["published-value"]
    assert facts.blockers[0].message.startswith(
        "published_value 'SENT' is not a value of outbox_st.state: invalid input value for "
        'enum outbox_state: "SENT"'
    )
    assert [b.code for b in no_value.blockers] == ["published-flag-value"]


@pytest.mark.newest_pg_only
def test_the_relay_sets_the_status_beside_the_timestamp_on_a_flat_outbox(dsn: str) -> None:
    settings = load_settings(STATUS_BESIDE.settings, environ={})
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(MODULITH_DDL)
        for n in range(5):
            conn.execute(
                "INSERT INTO event_publication (listener_id, serialized_event) VALUES (%s, %s)",
                (f"listener-{n}", json.dumps({"n": n})),
            )
    collector = Collector()
    relay = Relay(dsn, collector.factory(), spec=settings.spec,
                  options=RelayOptions(mode=Mode.flat, until_empty=True))  # fmt: skip
    relay.run()
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows: list[Any] = conn.execute(
            "SELECT status, completion_date IS NOT NULL, count(*) FROM event_publication "
            "GROUP BY 1, 2"
        ).fetchall()
    assert len(collector.messages) == 5
    assert rows == [("COMPLETED", True, 5)]


@pytest.mark.newest_pg_only
def test_plan_cli_shows_the_flags_bound_and_check_and_refuses_a_nullable_flag(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SENT_FLAG.ddl)
        conn.execute(EVENTUATE_DDL)
    names = ["--table", "outbox_sent", "--published-column", "sent"]
    shown = run_cli("plan", "--pattern", "hoper", "--format", "sql", *names, "--dsn", dsn)
    assert shown.returncode == 0, shown.stderr
    assert (
        'CREATE TABLE "public"."outbox_unpublished" PARTITION OF "public"."outbox_new" '
        "FOR VALUES IN ('false')" in shown.stdout
    )
    assert 'CHECK ("sent" IS NOT NULL AND "sent" <> \'false\') NOT VALID' in shown.stdout
    assert 'SET "published_at"' not in shown.stdout
    document = run_cli("plan", "--pattern", "hoper", "--format", "json", *names, "--dsn", dsn)
    spec = json.loads(document.stdout)["spec"]
    assert (spec["published_column"], spec["unpublished_value"], spec["published_value"]) == (
        "sent", "false", "true"
    )  # fmt: skip
    refused = run_cli("plan", "--pattern", "hoper", "--table", "message", "--published-column",
                      "published", "--id-kind", "application", "--dsn", dsn)  # fmt: skip
    error_line(refused, 2)
    assert "blocker 1/2: message.published is a nullable flag" in refused.stderr, refused.stderr


@pytest.mark.newest_pg_only
def test_steps_built_for_a_timestamp_refuse_a_flag_table_before_partitioning(dsn: str) -> None:
    """Revisions built without a database take the marker from the settings: unpinned on a
    flag table they would create a NULL partition no row enters. The partition's creation
    checks the column's kind first (online, and as a DO assertion offline)."""
    unpinned = SENT_FLAG.spec_settings().spec
    pinned = SENT_FLAG.spec_settings(unpublished_value="false", published_value="true").spec
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SENT_FLAG.ddl)
        wrong = conn.execute(marker_kind(Names(unpinned), unpinned.table).query).fetchall()
        right = conn.execute(marker_kind(Names(pinned), pinned.table).query).fetchall()
    assert right == []
    assert len(wrong) == 1
    assert wrong[0][0].startswith(
        '"public"."outbox_sent".sent is boolean, but these steps were built for a timestamp (NULL = '
        "unpublished) marker: set unpublished_value and published_value"
    )


@pytest.mark.newest_pg_only
def test_rehearse_fills_a_flag_outbox_with_published_and_unpublished_values(dsn: str) -> None:
    """The scratch fill wrote a timestamp (or NULL) into the marker: a flag column refused it."""
    spec = STATUS_ENUM.spec_settings().spec
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(STATUS_ENUM.ddl)
        conn.execute(
            "INSERT INTO outbox_st (payload, state) SELECT json_build_object('n', g), "
            "CASE WHEN g <= 6 THEN 'PUBLISHED' ELSE 'PENDING' END::outbox_state "
            "FROM generate_series(1, 8) g"
        )
        conn.execute("ANALYZE outbox_st")
    shape = read_shape(dsn, spec, "hoper")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE outbox_st; DROP TYPE outbox_state")
        rebuild(conn, shape, spec)
        filled = fill_synthetic(conn, shape, spec, 100)
        states = conn.execute(
            "SELECT state::text, count(*) FROM outbox_st GROUP BY 1 ORDER BY 1"
        ).fetchall()
    assert filled == 100
    assert states == [("PENDING", 2), ("PUBLISHED", 98)]


PARTITIONED_SENT = """
    CREATE TABLE outbox_sent_new (LIKE outbox_sent INCLUDING DEFAULTS) PARTITION BY LIST (sent);
    CREATE TABLE outbox_sent_unpublished PARTITION OF outbox_sent_new FOR VALUES IN (false);
    CREATE TABLE outbox_sent_published PARTITION OF outbox_sent_new DEFAULT;
    INSERT INTO outbox_sent_new (id, topic, payload, created_at, sent)
    SELECT g, 't', '{}', now() - interval '30 days' * (g % 2), g <= 6
    FROM generate_series(1, 10) g
"""


@pytest.mark.newest_pg_only
def test_maintenance_and_the_watch_backlog_of_a_flag_outbox(dsn: str) -> None:
    """Maintenance found the unpublished partition by `FOR VALUES IN (NULL)` only and aged
    rows by the marker; the watch counted `sent IS NULL`."""
    spec = SENT_FLAG.spec_settings().spec
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SENT_FLAG.ddl)
        conn.execute(PARTITIONED_SENT)
        backlog = watch_backlog(conn, spec)
        report = maintain_once(conn, spec, MaintenanceOptions(retention=timedelta(days=7)))
        left = conn.execute(
            "SELECT sent, count(*) FROM outbox_sent_new GROUP BY 1 ORDER BY 1"
        ).fetchall()
        # eventuate's creation_time is epoch milliseconds: no age to measure, said so
        conn.execute(EVENTUATE.ddl)
        conn.execute(
            "CREATE TABLE message_new (LIKE message INCLUDING DEFAULTS) "
            "PARTITION BY LIST (published); "
            "CREATE TABLE message_unpublished PARTITION OF message_new FOR VALUES IN (0); "
            "CREATE TABLE message_published PARTITION OF message_new DEFAULT"
        )
        eventuate = maintain_once(conn, EVENTUATE.spec_settings().spec,
                                  MaintenanceOptions(retention=timedelta(days=7)))  # fmt: skip
    assert [(b["table"], b["unpublished"]) for b in backlog] == [
        ("outbox_sent", 0), ("outbox_sent_new", 4)
    ]  # fmt: skip
    assert report.unpublished == "public.outbox_sent_unpublished"
    assert report.retention is not None and report.retention.deleted_rows == 3  # old published rows
    assert left == [(False, 4), (True, 3)]
    assert eventuate.unpublished == "public.message_unpublished"
    assert eventuate.retention is not None
    assert eventuate.retention.skipped == (
        "the publication marker is a flag and created_column is unset: no age to measure"
    )


@pytest.mark.newest_pg_only
def test_the_relay_publishes_eventuates_table_as_published_before_the_migration(
    dsn: str,
) -> None:
    """Only partitioning needs the flag NOT NULL: the relay of the flat table (V1) takes
    eventuate's table as it is, claims `published = 0` and sets 1 (its headers are another
    test's subject)."""
    settings = EVENTUATE.spec_settings(headers_column="")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EVENTUATE_DDL)
        for n in range(1, 6):
            conn.execute(psycopg.sql.SQL(EVENTUATE.insert).format(
                table=psycopg.sql.Identifier("message")), {"n": n})  # fmt: skip
    collector = Collector()
    relay = Relay(dsn, collector.factory(), spec=settings.spec,
                  options=RelayOptions(mode=Mode.flat, until_empty=True))  # fmt: skip
    relay.run()
    with psycopg.connect(dsn, autocommit=True) as conn:
        states = conn.execute("SELECT published, count(*) FROM message GROUP BY 1").fetchall()
    assert sorted(json.loads(m.payload)["n"] for m in collector.messages) == [1, 2, 3, 4, 5]
    assert states == [(1, 5)]
