"""`introspect.judge`: the blockers and warnings drawn from facts (pure; no database)."""

from __future__ import annotations

import dataclasses

import pytest

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import SchemaError
from outbox_migrate.introspect import ColumnFact, TableFacts, judge, raise_for_blockers

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
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def judged(spec: OutboxSpec | None = None, **changes: object) -> TableFacts:
    found = facts(**changes)
    judge(found, spec or OutboxSpec())
    return found


def test_a_sound_outbox_has_nothing_to_report() -> None:
    found = judged()
    assert found.blockers == [] and found.warnings == []
    assert found.id_top == 12 and found.identity_start(1_000_000) == 1_000_012
    raise_for_blockers(found)


def test_a_partition_is_already_migrated() -> None:
    found = judged(is_partition=True)
    assert [(b.code, b.message) for b in found.blockers] == [
        ("already-partitioned", "outbox is already a partition")
    ]


def test_missing_publication_column() -> None:
    found = judged(columns=[ID, PAYLOAD])
    assert [b.code for b in found.blockers] == ["published-missing"]
    assert found.blockers[0].message == "outbox has no column 'published_at'"


def test_timestamp_without_time_zone_is_accepted() -> None:
    plain = dataclasses.replace(PUBLISHED, type="timestamp without time zone")
    assert judged(columns=[ID, PAYLOAD, plain]).blockers == []


def test_identity_start_near_the_bigint_limit_blocks() -> None:
    found = judged(max_id=2**62)
    assert [b.code for b in found.blockers] == ["id-overflow"]
    assert judged(max_id=2**62 - 1_000_000).blockers == []


def test_names_outside_public_are_qualified_in_messages() -> None:
    spec = OutboxSpec(schema="billing")
    found = judged(spec, schema="billing", foreign_keys_in=[("fk", "billing.receipts")])
    assert (
        found.blockers[0].message == "foreign key fk on billing.receipts references billing.outbox"
    )


def test_several_blockers_are_one_line_with_a_count() -> None:
    found = judged(columns=[dataclasses.replace(ID, type="integer"), PAYLOAD])
    assert [b.code for b in found.blockers] == ["id-type", "published-missing"]
    with pytest.raises(SchemaError) as raised:
        raise_for_blockers(found)
    assert str(raised.value) == (
        "outbox.id is integer, not bigint: ALTER the column to bigint first; the new identity "
        "starts 1,000,000 above the current maximum and must not overflow (+1 more blockers)"
    )


def test_warnings_in_a_stable_order() -> None:
    generated = ColumnFact("size", "integer", "length(payload::text)", False, None, "", "s")
    found = judged(
        columns=[ID, PAYLOAD, PUBLISHED, generated],
        publications=["cdc"],
        triggers=[("audit", "CREATE TRIGGER audit ...")],
        foreign_keys_out=[("tenant_fk", "tenants"), ("user_fk", "users")],
    )
    assert found.blockers == []
    assert [w.code for w in found.warnings] == [
        "cdc-publication", "generated-column", "trigger", "fk-out",
    ]  # fmt: skip
    assert (
        found.warnings[3].message == "outbox has foreign keys to other tables (tenant_fk, user_fk)"
    )


def test_identity_generation_for_reversing_drop_identity() -> None:
    spec = OutboxSpec()
    assert facts().identity_generation(spec) == "ALWAYS"
    by_default = dataclasses.replace(ID, identity="d")
    assert facts(columns=[by_default, PAYLOAD, PUBLISHED]).identity_generation(spec) == (
        "BY DEFAULT"
    )
