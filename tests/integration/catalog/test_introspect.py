"""Introspection of a live outbox: the facts, the blockers (with what to do) and the warnings.

The facts test runs on every server version (the catalog queries differ across releases, e.g.
PostgreSQL 18 lists NOT NULL in pg_constraint); the blocker and warning cases do not depend on
the version and run once.
"""

from __future__ import annotations

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from outbox_migrate_harness.testing.server import Server

from outbox_migrate.advisory.introspect import TableFacts, introspect, raise_for_blockers
from outbox_migrate.advisory.lost_semantics import LAYOUT_WARNINGS
from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import SchemaError

SPEC = OutboxSpec()


def codes(findings: list) -> list[str]:
    return [f.code for f in findings]


def test_facts_of_a_flat_outbox(conn: psycopg.Connection, pg_server: Server) -> None:
    create_flat_outbox(conn)
    insert_rows(conn, "outbox", 120, published=True)
    insert_rows(conn, "outbox", 8)
    conn.execute("ANALYZE outbox")
    conn.execute("CREATE TABLE tenants (id int8 PRIMARY KEY)")
    conn.execute("ALTER TABLE outbox ADD COLUMN tenant_id int8 REFERENCES tenants (id)")
    facts = introspect(conn, SPEC)

    assert facts.server_version == pg_server.version
    assert facts.server_version_text.startswith(str(pg_server.version))
    assert (facts.relkind, facts.is_partition) == ("r", False)
    names = [c.name for c in facts.columns]
    assert names == [
        "id", "event_type", "message_key", "payload", "created_at", "published_at", "tenant_id",
    ]  # fmt: skip
    id_col, published = facts.column("id"), facts.column("published_at")
    assert id_col is not None and published is not None
    assert (id_col.type, id_col.identity, id_col.not_null) == ("bigint", "a", True)
    assert (published.type, published.not_null) == ("timestamp with time zone", False)
    assert facts.column("event_type").default == "'event'::text"  # type: ignore[union-attr]
    assert facts.column("message_key").collation == "default"  # type: ignore[union-attr]
    assert facts.max_id == 128 and facts.sequence_last_value == 128
    assert facts.sequence == "public.outbox_id_seq"
    assert facts.identity_start(SPEC.id_headroom) == 1_000_128
    assert facts.unpublished == 8
    assert facts.row_estimate == 128
    assert facts.total_bytes > facts.heap_bytes > 0
    assert {name for name, _ in facts.indexes} == {"outbox_pkey", "outbox_unpublished_id_idx"}
    assert facts.constraints == [
        ("outbox_pkey", "PRIMARY KEY (id)", True),
        ("outbox_tenant_id_fkey", "FOREIGN KEY (tenant_id) REFERENCES tenants(id)", True),
    ]  # and no NOT NULL entries, which PostgreSQL 18 also keeps in pg_constraint
    assert facts.foreign_keys_out == [("outbox_tenant_id_fkey", "tenants")]
    assert facts.foreign_keys_in == [] and facts.triggers == [] and facts.publications == []
    assert facts.new_table_state == {}
    assert facts.blockers == []
    assert codes(facts.warnings) == ["fk-out", *LAYOUT_WARNINGS]
    raise_for_blockers(facts)  # nothing to raise


@pytest.mark.newest_pg_only
def test_new_tables_already_present_are_reported(conn: psycopg.Connection) -> None:
    create_flat_outbox(conn)
    conn.execute(
        "CREATE TABLE outbox_new (LIKE outbox INCLUDING DEFAULTS) PARTITION BY LIST (published_at)"
    )
    conn.execute("CREATE TABLE outbox_unpublished PARTITION OF outbox_new FOR VALUES IN (NULL)")
    facts = introspect(conn, SPEC)
    assert facts.new_table_state == {
        "outbox_new": "partitioned table",
        "outbox_unpublished": "partition of outbox_new FOR VALUES IN (NULL)",
    }


@pytest.mark.newest_pg_only
def test_missing_table_is_a_schema_error(conn: psycopg.Connection) -> None:
    with pytest.raises(SchemaError, match=r"table outbox does not exist in database 't_"):
        introspect(conn, SPEC)
    with pytest.raises(SchemaError, match=r"table billing\.events does not exist"):
        introspect(conn, OutboxSpec(schema="billing", table="events"))


def blocked(conn: psycopg.Connection, ddl: str) -> TableFacts:
    conn.execute(ddl)
    return introspect(conn, SPEC)


OUTBOX_COLUMNS = "payload json NOT NULL, created_at timestamptz NOT NULL DEFAULT now()"


@pytest.mark.newest_pg_only
@pytest.mark.parametrize(
    ("ddl", "code", "message", "remedy"),
    [
        (
            # a default keeps ids unique by construction (without one, lost-unique comes too)
            f"CREATE TABLE outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), "
            f"{OUTBOX_COLUMNS}, published_at timestamptz)",
            "id-application",
            "outbox.id is uuid: the application supplies the ids",
            'set id_kind = "application"',
        ),
        (
            f"CREATE TABLE outbox (id smallint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            f"{OUTBOX_COLUMNS}, published_at timestamptz)",
            "id-type",
            "outbox.id is smallint",
            'ALTER TABLE "public"."outbox" ALTER COLUMN "id" TYPE bigint',
        ),
        (
            f"CREATE TABLE outbox (id int8 PRIMARY KEY, {OUTBOX_COLUMNS}, "
            "published_at timestamptz)",
            "id-no-generator",
            "outbox.id is bigint with neither an identity nor a sequence default: the "
            "application supplies the ids",
            'CREATE SEQUENCE "public"."outbox_id_seq" OWNED BY "public"."outbox"."id"',
        ),
        (
            f"CREATE TABLE outbox (id int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            f"{OUTBOX_COLUMNS}, published_at boolean)",
            # a flag may be the marker, but this one has no unpublished value to partition by
            "published-flag-value",
            "outbox.published_at is a boolean flag with no constant DEFAULT",
            "set unpublished_value",
        ),
        (
            f"CREATE TABLE outbox (id int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            f"{OUTBOX_COLUMNS}, published_at jsonb)",
            "published-type",
            "outbox.published_at is jsonb, neither a timestamp nor a flag",
            "nullable publication timestamp or a flag",
        ),
        (
            f"CREATE TABLE outbox (id int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            f"{OUTBOX_COLUMNS}, published_at timestamptz NOT NULL DEFAULT now())",
            "published-not-null",
            "outbox.published_at is NOT NULL",
            "unpublished rows need NULL there",
        ),
        (
            f"CREATE TABLE outbox (outbox_id int8 GENERATED ALWAYS AS IDENTITY, {OUTBOX_COLUMNS}, "
            "published_at timestamptz)",
            "id-missing",
            "outbox has no column 'id'",
            "set id_column",
        ),
        (
            "CREATE TABLE outbox (id int8 GENERATED ALWAYS AS IDENTITY, payload json, "
            "published_at timestamptz) PARTITION BY LIST (published_at)",
            "already-partitioned",
            "outbox is already partitioned",
            "nothing to migrate",
        ),
    ],
    ids=[
        "uuid-id",
        "smallint-id",
        "no-generator",
        "published-boolean",
        "published-jsonb",
        "published-not-null",
        "no-id",
        "partitioned",
    ],
)
def test_schema_blockers(
    conn: psycopg.Connection, ddl: str, code: str, message: str, remedy: str
) -> None:
    facts = blocked(conn, ddl)
    assert codes(facts.blockers) == [code]
    assert facts.blockers[0].message == message
    assert remedy in facts.blockers[0].remedy
    with pytest.raises(SchemaError) as raised:
        raise_for_blockers(facts)
    assert str(raised.value).startswith(f"{message}: ")
    assert "\n" not in str(raised.value)


@pytest.mark.newest_pg_only
def test_foreign_key_into_the_outbox_blocks(conn: psycopg.Connection) -> None:
    create_flat_outbox(conn)
    conn.execute("CREATE TABLE receipts (outbox_id int8 REFERENCES outbox (id))")
    conn.execute("CREATE TABLE audits (outbox_id int8 CONSTRAINT audit_fk REFERENCES outbox (id))")
    facts = introspect(conn, SPEC)
    assert facts.foreign_keys_in == [
        ("audit_fk", "audits"),
        ("receipts_outbox_id_fkey", "receipts"),
    ]
    assert codes(facts.blockers) == ["fk-into-outbox", "fk-into-outbox"]
    assert "uniqueness of ids is not enforced across partitions" in facts.blockers[0].remedy
    with pytest.raises(SchemaError, match=r"^2 blockers stop the migration of outbox") as raised:
        raise_for_blockers(facts)
    assert [line.split(": ")[1] for line in str(raised.value).splitlines()[1:]] == [
        'foreign key "audit_fk" on audits references outbox',
        'foreign key "receipts_outbox_id_fkey" on receipts references outbox',
    ]
    # the printed fix runs, and clears the blockers (a name with a space and a capital too)
    conn.execute('ALTER TABLE audits RENAME CONSTRAINT audit_fk TO "Audit fk"')
    for blocker in introspect(conn, SPEC).blockers:
        conn.execute(blocker.fix_sql)
    assert introspect(conn, SPEC).blockers == []


@pytest.mark.newest_pg_only
def test_cdc_publications_and_triggers_are_warnings(conn: psycopg.Connection) -> None:
    create_flat_outbox(conn)
    conn.execute("CREATE PUBLICATION only_outbox FOR TABLE outbox")
    conn.execute("CREATE PUBLICATION everything FOR ALL TABLES")
    conn.execute("CREATE PUBLICATION unrelated")
    conn.execute(
        "CREATE FUNCTION touch() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$"
    )
    conn.execute(
        "CREATE TRIGGER outbox_touch BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION touch()"
    )
    facts = introspect(conn, SPEC)
    assert facts.blockers == []
    assert facts.publications == ["everything", "only_outbox"]
    assert codes(facts.warnings) == ["cdc-publication", "cdc-publication", *LAYOUT_WARNINGS]
    assert "covers the partitions by itself" in facts.warnings[0].remedy  # everything
    assert "adds the unpublished partition" in facts.warnings[1].remedy  # only_outbox
    assert [(p.name, p.explicit, p.all_tables) for p in facts.publication_details] == [
        ("everything", False, True), ("only_outbox", True, False)
    ]  # fmt: skip
    trigger = facts.objects[-1]
    assert (trigger.kind, trigger.name) == ("trigger", "outbox_touch")
    assert "It is not carried to outbox_new" in trigger.fate
    raise_for_blockers(facts)  # warnings never stop the plan


GENERATED_OUTBOX = (
    "CREATE TABLE outbox (id int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
    "event_type text NOT NULL DEFAULT 'event', message_key text, payload json NOT NULL, "
    "created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz, "
    "payload_bytes int GENERATED ALWAYS AS (length(payload::text)) STORED)"
)


@pytest.mark.newest_pg_only
def test_generated_column_is_a_warning(conn: psycopg.Connection) -> None:
    conn.execute(GENERATED_OUTBOX)
    facts = introspect(conn, SPEC)
    assert facts.blockers == []
    assert codes(facts.warnings) == ["generated-column", *LAYOUT_WARNINGS]
    assert facts.warnings[0].message == "outbox.payload_bytes is a generated column"
    assert "HOPIA" in facts.warnings[0].remedy and "COP, COPRA or HOP" in facts.warnings[0].remedy


@pytest.mark.newest_pg_only
def test_why_a_generated_column_is_warned_about(conn: psycopg.Connection) -> None:
    """HOPIA's copy trigger copies the whole row; with a generated column the relay's
    publishing UPDATE fails, so publication would stop."""
    from psycopg import errors

    from outbox_migrate.patterns import build_pattern

    conn.execute(GENERATED_OUTBOX)
    for step in build_pattern("hopia").phase("V2").steps:
        for statement in step.statements:
            conn.execute(statement)
    insert_rows(conn, "outbox_new", 3)
    with pytest.raises(errors.GeneratedAlways):
        conn.execute("UPDATE outbox_new SET published_at = now() WHERE published_at IS NULL")


@pytest.mark.parametrize(
    ("ddl", "sequence", "owned"),
    [
        ("CREATE TABLE outbox (id bigserial PRIMARY KEY, {cols})", "public.outbox_id_seq", True),
        ("CREATE TABLE outbox (id serial PRIMARY KEY, {cols})", "public.outbox_id_seq", True),
        (
            "CREATE SEQUENCE shared_ids START 500; CREATE TABLE outbox (id int8 PRIMARY KEY "
            "DEFAULT nextval('shared_ids'), {cols})",
            "shared_ids",
            False,
        ),
    ],
    ids=["bigserial", "serial", "nextval-not-owned"],
)
def test_sequence_defaults_are_database_ids(
    conn: psycopg.Connection, ddl: str, sequence: str, owned: bool
) -> None:
    """Serial, bigserial and a nextval default on a sequence the column does not own are all
    a first-class id kind: the sequence is found, its last value counts towards the new
    identity's start, and nothing blocks."""
    conn.execute(ddl.format(cols=f"{OUTBOX_COLUMNS}, published_at timestamptz"))
    conn.execute("INSERT INTO outbox (payload) SELECT '{}' FROM generate_series(1, 3)")
    facts = introspect(conn, SPEC)
    assert facts.blockers == []
    assert facts.id_kind(SPEC) == "sequence"
    assert (facts.sequence, facts.sequence_owned) == (sequence, owned)
    assert facts.sequence_last_value == facts.max_id
    assert codes(facts.notes) == ["id-sequence"]
