"""`introspect.judge`: the blockers and warnings drawn from facts (pure; no database)."""

from __future__ import annotations

import dataclasses

import pytest

from outbox_migrate.advisory.introspect import ColumnFact, TableFacts, judge, raise_for_blockers
from outbox_migrate.advisory.lost_semantics import LAYOUT_WARNINGS
from outbox_migrate.advisory.table_facts import UniqueKey
from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import Blocked, SchemaError
from outbox_migrate.patterns.model import PublicationFact

ID = ColumnFact("id", "bigint", None, True, None, "a", "")
PUBLISHED = ColumnFact("published_at", "timestamp with time zone", None, False, None, "", "")
PAYLOAD = ColumnFact("payload", "json", None, True, None, "", "")


def facts(**changes: object) -> TableFacts:
    base = TableFacts(
        schema="public", table="outbox", server_version=17, server_version_text="17.2",
        relkind="r", is_partition=False, columns=[ID, PAYLOAD, PUBLISHED], max_id=10,
        sequence="public.outbox_id_seq", sequence_last_value=12, row_estimate=10, unpublished=1,
        total_bytes=8192, heap_bytes=8192, inserts=12, indexes=[], constraints=[], triggers=[],
        foreign_keys_in=[], foreign_keys_out=[], publications=[],
        index_details=[("outbox_pkey", "CREATE UNIQUE INDEX outbox_pkey ON public.outbox "
                        "USING btree (id)", True, True, True)],
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def judged(spec: OutboxSpec | str | None = None, **changes: object) -> TableFacts:
    """Judge facts; `spec` may be a pattern name (with the default spec)."""
    found = facts(**changes)
    if isinstance(spec, str):
        judge(found, OutboxSpec(), spec)
    else:
        judge(found, spec or OutboxSpec())
    return found


def test_a_sound_outbox_has_nothing_to_report() -> None:
    found = judged()
    assert found.blockers == []
    assert [w.code for w in found.warnings] == list(LAYOUT_WARNINGS)
    assert found.id_top == 12 and found.identity_start(1_000_000) == 1_000_012
    raise_for_blockers(found)


def test_a_partition_is_already_migrated() -> None:
    found = judged(is_partition=True)
    assert [(b.code, b.message) for b in found.blockers] == [
        ("already-partitioned", "outbox is already a partition")
    ]


def test_missing_publication_column() -> None:
    """A nullable timestamp named like a marker is a setting to fix, and `plan` names it."""
    sent = dataclasses.replace(PUBLISHED, name="sent_at")
    found = judged(columns=[ID, PAYLOAD, sent])
    assert [b.code for b in found.blockers] == ["published-missing"]
    assert found.blockers[0].message == "outbox has no column 'published_at'"
    assert found.blockers[0].remedy.startswith(
        'set the column the sender sets on delivery: published_column = "sent_at" (a nullable '
    )


def test_timestamp_without_time_zone_is_accepted() -> None:
    plain = dataclasses.replace(PUBLISHED, type="timestamp without time zone")
    assert judged(columns=[ID, PAYLOAD, plain]).blockers == []


def test_identity_start_near_the_bigint_limit_blocks() -> None:
    found = judged(max_id=2**62)
    assert [b.code for b in found.blockers] == ["id-overflow"]
    assert judged(max_id=2**62 - 1_000_001).blockers == []


def test_names_outside_public_are_qualified_in_messages() -> None:
    spec = OutboxSpec(schema="billing")
    found = judged(spec, schema="billing", foreign_keys_in=[("fk", "billing.receipts")])
    assert (
        found.blockers[0].message
        == 'foreign key "fk" on billing.receipts references billing.outbox'
    )


def test_several_blockers_are_listed_at_once_each_with_its_fix() -> None:
    """Before, only the first blocker was named ("+1 more blockers"): a user fixed and re-ran
    once per blocker."""
    found = judged(columns=[dataclasses.replace(ID, type="uuid", identity=""), PAYLOAD])
    assert [b.code for b in found.blockers] == ["id-application", "delete-on-delivery"]
    with pytest.raises(Blocked) as raised:
        raise_for_blockers(found)
    summary, *lines = str(raised.value).splitlines()
    assert summary == "2 blockers stop the migration of outbox, each listed with its fix"
    assert lines == raised.value.details
    assert lines[0].startswith(
        "blocker 1/2: outbox.id is uuid: the application supplies the ids: set id_kind = "
        '"application"'
    )
    assert lines[1].startswith("blocker 2/2: outbox has no publication marker")
    assert "this outbox deletes delivered rows" in lines[1]
    only = judged(columns=[dataclasses.replace(ID, type="uuid", identity=""), PAYLOAD, PUBLISHED])
    with pytest.raises(SchemaError) as one:
        raise_for_blockers(only)
    assert not isinstance(one.value, Blocked)
    assert str(one.value).startswith("outbox.id is uuid: the application supplies the ids")


def test_warnings_in_a_stable_order() -> None:
    generated = ColumnFact("size", "integer", "length(payload::text)", False, None, "", "s")
    found = judged(
        columns=[ID, PAYLOAD, PUBLISHED, generated],
        publications=["cdc"],
        publication_details=[PublicationFact("cdc")],
        triggers=[("audit", "CREATE TRIGGER audit ...")],
        foreign_keys_out=[("tenant_fk", "tenants"), ("user_fk", "users")],
        index_details=[],
    )
    assert found.blockers == []
    assert [w.code for w in found.warnings] == [
        "cdc-publication", "generated-column", "fk-out", "no-unique-id", *LAYOUT_WARNINGS,
    ]  # fmt: skip
    assert (
        found.warnings[2].message == "outbox has foreign keys to other tables (tenant_fk, user_fk)"
    )


def test_identity_generation_for_reversing_drop_identity() -> None:
    spec = OutboxSpec()
    assert facts().identity_generation(spec) == "ALWAYS"
    by_default = dataclasses.replace(ID, identity="d")
    assert facts(columns=[by_default, PAYLOAD, PUBLISHED]).identity_generation(spec) == (
        "BY DEFAULT"
    )


def test_id_kinds() -> None:
    """Identity, serial/nextval (a note, not a blocker: the new table gets its own identity),
    an integer without generator (blocker with the SQL), application ids (config)."""
    spec = OutboxSpec()
    serial = dataclasses.replace(ID, identity="", default="nextval('outbox_id_seq'::regclass)")
    found = judged(columns=[serial, PAYLOAD, PUBLISHED], sequence_owned=True)
    assert found.blockers == [] and found.id_kind(spec) == "sequence"
    assert [n.code for n in found.notes] == ["id-sequence"]
    assert "serial: the column owns it" in found.notes[0].message
    assert "1,000,012" in found.notes[0].remedy
    bare = dataclasses.replace(ID, identity="", default=None)
    found = judged(columns=[bare, PAYLOAD, PUBLISHED], sequence=None, sequence_last_value=None)
    assert [b.code for b in found.blockers] == ["id-no-generator"]
    assert 'set id_kind = "application"' in found.blockers[0].remedy
    assert (
        'CREATE SEQUENCE "public"."outbox_id_seq" OWNED BY "public"."outbox"."id"'
        in found.blockers[0].remedy
    )
    assert found.blockers[0].fix_sql in found.blockers[0].remedy
    # the application supplies integer ids (snowflake ids): id_kind = application answers
    found = judged(OutboxSpec(id_kind="application"), columns=[bare, PAYLOAD, PUBLISHED],
                   sequence=None, sequence_last_value=None)  # fmt: skip
    assert found.blockers == [] and [n.code for n in found.notes] == ["id-application"]
    assert "takes every id as given" in found.notes[0].remedy
    uuid = dataclasses.replace(ID, type="uuid", identity="", default="gen_random_uuid()")
    columns = [uuid, PAYLOAD, PUBLISHED]
    application = OutboxSpec(id_kind="application")
    # without id_kind: one line saying which setting to add
    found = judged(columns=columns, sequence=None)
    assert [b.code for b in found.blockers] == ["id-application"]
    assert 'set id_kind = "application"' in found.blockers[0].remedy
    # uuidv7/ULID: claimed by id, gates on the gate sequence (a note)
    found = judged(application, columns=columns, sequence=None)
    assert found.blockers == [] and [n.code for n in found.notes] == ["id-application"]
    assert "outbox_gate_seq" in found.notes[0].remedy
    # random uuids need a claim order
    found = judged(application, columns=columns, sequence=None, random_uuid_ids=True)
    assert [b.code for b in found.blockers] == ["order-random-uuid"]
    assert 'order_column = "created_at"' in found.blockers[0].remedy
    created = ColumnFact("created_at", "timestamp with time zone", "now()", True, None, "", "")
    by_time = OutboxSpec(id_kind="application", order_column="created_at")
    found = judged(by_time, columns=[*columns, created], sequence=None, random_uuid_ids=True)
    assert found.blockers == []
    assert [b.code for b in judged(by_time, columns=columns, sequence=None).blockers] == [
        "order-missing"
    ]
    varchar = dataclasses.replace(uuid, type="character varying(26)", default=None)
    assert judged(application, columns=[varchar, PAYLOAD, PUBLISHED], sequence=None).blockers == []
    found = judged(OutboxSpec(id_kind="application"))
    assert [b.code for b in found.blockers] == ["id-kind-mismatch"]
    tiny = dataclasses.replace(ID, type="smallint", identity="")
    found = judged(columns=[tiny, PAYLOAD, PUBLISHED])
    assert [b.code for b in found.blockers] == ["id-type"]
    assert 'ALTER TABLE "public"."outbox" ALTER COLUMN "id" TYPE bigint' in found.blockers[0].remedy
    small = dataclasses.replace(ID, type="integer")
    assert [b.code for b in judged(columns=[small, PAYLOAD, PUBLISHED],
                                   max_id=2**30).blockers] == ["id-overflow"]  # fmt: skip


def test_objects_and_what_happens_to_them() -> None:
    found = judged(
        "hoper",
        index_details=[
            ("outbox_unpublished", "CREATE INDEX outbox_unpublished ON public.outbox USING btree "
             "(id) WHERE (published_at IS NULL)", False, False, True),
            ("by_key", "CREATE UNIQUE INDEX by_key ON public.outbox USING btree (message_key)",
             False, True, True),
        ],
        check_details=[("small", "CHECK ((length(payload::text) < 100))", True, False),
                       ("lazy", "CHECK ((id > 0)) NOT VALID", False, False)],
        trigger_details=[("audit", "CREATE TRIGGER audit AFTER INSERT ON public.outbox FOR "
                          "EACH ROW EXECUTE FUNCTION audit()", "O")],
        unique_keys=[UniqueKey("by_key", "unique index", ("message_key",), False, "")],
    )  # fmt: skip
    kinds = [(o.kind, o.name) for o in found.objects]
    assert kinds == [("index", "outbox_unpublished"), ("unique index", "by_key"),
                     ("check", "small"), ("check", "lazy"), ("trigger", "audit")]  # fmt: skip
    fates = {o.name: o.fate for o in found.objects}
    assert 'DROP INDEX CONCURRENTLY "public"."outbox_unpublished"' in fates["outbox_unpublished"]
    assert "must include the partition key (published_at)" in fates["by_key"]
    assert "copied to outbox_new in V2" in fates["small"]
    assert "HOPIA's copy trigger" in fates["audit"] and "fires it" in fates["audit"]
    # no unique index on id alone: HOPER's copy-back needs one, so for HOPER it blocks; the
    # unique message_key is a rule the partitioned table cannot keep
    assert [b.code for b in found.blockers] == ["check-not-valid", "no-unique-id", "lost-unique"]
    assert "nothing enforces it on outbox_new (lost-unique)" in fates["by_key"]


def test_status_column_outboxes_are_refused_with_the_settings_that_partition_by_it() -> None:
    """Open Outbox Relay's layout: a status column and delivered_at, no published_at. The
    status itself can be the marker (its DEFAULT is the unpublished value)."""
    status = ColumnFact("status", "text", "'PENDING'::text", True, None, "", "")
    delivered = dataclasses.replace(PUBLISHED, name="delivered_at")
    found = judged(columns=[ID, PAYLOAD, status, delivered])
    assert [b.code for b in found.blockers] == ["published-missing"]
    assert (
        'published_column = "status", published_value = the value the sender sets (text '
        "DEFAULT PENDING" in found.blockers[0].remedy
    )
    assert 'or published_column = "delivered_at" (a nullable' in found.blockers[0].remedy
    by_status = OutboxSpec(published_column="status", published_value="DELIVERED")
    found = judged(by_status, columns=[ID, PAYLOAD, status, delivered])
    assert found.blockers == []
    assert [n.message for n in found.notes if n.code == "flag-marker"] == [
        "outbox.status is a flag: status = PENDING is unpublished, the relay sets DELIVERED"
    ]


def test_a_column_list_on_a_publication_of_changes_is_a_blocker() -> None:
    """The partition must get REPLICA IDENTITY FULL for the mark to pass an UPDATE/DELETE
    publication, and a column list cannot cover a full identity: every mark would fail."""
    listed = PublicationFact("dbz", columns=("id", "payload", "published_at"))
    assert [b.code for b in judged(publication_details=[listed]).blockers] == ["cdc-column-list"]
    inserts_only = PublicationFact("dbz", columns=("id", "payload"), update=False, delete=False)
    assert judged(publication_details=[inserts_only]).blockers == []
    found = judged(publications=["dbz"], publication_details=[PublicationFact("dbz")])
    assert found.blockers == []
    assert "publish-unpublished-partition" in found.warnings[0].remedy
