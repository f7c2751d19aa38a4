"""CDC users migrating (issue 18), without a server: the conditional step that carries the flat
outbox's publication to the partitioned outbox, and `plan`'s per-phase CDC view."""

from __future__ import annotations

import pytest

from outbox_migrate.advisory.cdc_view import phase_views
from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import PATTERN_NAMES, BuildOptions, build_pattern
from outbox_migrate.patterns.model import PublicationFact, Step

SPEC = OutboxSpec()
LISTED = PublicationFact("dbz")
ALL_TABLES = PublicationFact("everything", explicit=False, all_tables=True)


def cdc_step(pattern: str, *publications: PublicationFact) -> Step | None:
    built = build_pattern(pattern, SPEC, BuildOptions(publications=publications))
    return next((s for s in built.steps() if s.kind == "publish-unpublished-partition"), None)


@pytest.mark.parametrize("pattern", PATTERN_NAMES)
def test_the_step_exists_only_for_a_published_outbox_and_leaves_other_checksums(
    pattern: str,
) -> None:
    plain = build_pattern(pattern, SPEC)
    published = build_pattern(pattern, SPEC, BuildOptions(publications=(LISTED,)))
    assert cdc_step(pattern) is None
    extra = [s for s in published.steps() if s.id not in {p.id for p in plain.steps()}]
    assert [s.kind for s in extra] == ["publish-unpublished-partition"]
    assert extra[0].phase == "V2"
    # every other step is the same step: in-flight migrations keep matching their checksums
    before = {s.id: s.checksum() for s in plain.steps()}
    assert {s.id: s.checksum() for s in published.steps() if s.id in before} == before
    # before any version writes to the partitioned table: V2's steps run before V2's deploy
    v2 = published.phase("V2")
    assert v2.steps[-1].kind != "publish-unpublished-partition"
    assert v2.steps[-1].app_after.startswith("ready to deploy V2")


def test_a_listed_publication_gets_the_unpublished_partition_with_its_filter() -> None:
    filtered = PublicationFact("dbz", row_filter="(tenant <> 'test'::text)",
                               columns=("id", "payload", "published_at"))  # fmt: skip
    step = cdc_step("hoper", filtered)
    assert step is not None
    assert step.sql_texts() == [
        'ALTER PUBLICATION "dbz" ADD TABLE "public"."outbox_unpublished" '
        '("id", "payload", "published_at") WHERE ((tenant <> \'test\'::text))',
        'ALTER TABLE "public"."outbox_unpublished" REPLICA IDENTITY FULL',
    ]
    assert [s.as_string(None) for s in step.reverse or ()] == [
        'ALTER PUBLICATION "dbz" DROP TABLE "public"."outbox_unpublished"',
        'ALTER TABLE "public"."outbox_unpublished" REPLICA IDENTITY DEFAULT',
    ]
    assert [(c.kind, c.name, c.on) for c in step.creates] == [
        ("publication-rel", "dbz", "outbox_unpublished")
    ]
    # checked under the lock, in the DDL's transaction: still listed as planned, not yet added
    assert {c.name for c in step.preconditions} >= {
        "publication-includes:dbz:old", "publication-excludes:dbz"
    }  # fmt: skip
    assert all(c.at.value == "locked" for c in step.preconditions)


def test_an_insert_only_publication_needs_no_replica_identity() -> None:
    step = cdc_step("hopia", PublicationFact("dbz", update=False, delete=False))
    assert step is not None
    assert step.sql_texts() == ['ALTER PUBLICATION "dbz" ADD TABLE "public"."outbox_unpublished"']


def test_all_tables_needs_no_membership_but_replica_identity_on_both_partitions() -> None:
    step = cdc_step("hop", ALL_TABLES)
    assert step is not None and step.creates == ()
    assert step.sql_texts() == [
        'ALTER TABLE "public"."outbox_unpublished" REPLICA IDENTITY FULL',
        'ALTER TABLE "public"."outbox_published" REPLICA IDENTITY FULL',
    ]
    assert cdc_step("hop", PublicationFact("x", explicit=False, all_tables=True, update=False,
                                           delete=False)) is None  # fmt: skip
    copra = cdc_step("copra", ALL_TABLES)  # no published partition of its own in COPRA
    assert copra is not None and len(copra.sql_texts()) == 1


def test_the_cdc_view_of_hoper_per_phase() -> None:
    pattern = build_pattern("hoper", SPEC, BuildOptions(publications=(LISTED,)))
    views = {name: found[0] for name, found in phase_views(pattern, SPEC, [LISTED]).items()}
    assert views["V1"].messages_on == ["outbox"]
    assert views["V1"].consumer == "nothing to change"
    assert views["V2"].messages_on == ["outbox", "outbox_unpublished"]
    assert "must also accept outbox_unpublished" in views["V2"].consumer
    assert {(s.event, s.relation) for s in views["V2"].also} == {
        ("UPDATE", "outbox"), ("DELETE", "outbox_unpublished")
    }  # fmt: skip
    assert views["V3"].messages_on == ["outbox_unpublished"]
    # after the swap the mark moves each row into the old table, which is still published
    assert ("INSERT", "outbox") in {(s.event, s.relation) for s in views["V4"].also}
    assert "published_at IS NULL" in views["V4"].consumer
    assert any("copy-back" in s.cause for s in views["copy-back"].also)


def test_the_cdc_view_of_hopia_warns_about_the_copy_trigger_from_v2() -> None:
    pattern = build_pattern("hopia", SPEC, BuildOptions(publications=(LISTED,)))
    v2 = phase_views(pattern, SPEC, [LISTED])["V2"][0]
    assert any("copy trigger" in s.cause and s.relation == "outbox" for s in v2.also)


def test_the_cdc_view_of_a_publication_via_root_names_the_parent() -> None:
    via_root = PublicationFact("all", explicit=False, all_tables=True, via_root=True)
    pattern = build_pattern("hop", SPEC, BuildOptions(publications=(via_root,)))
    v3 = phase_views(pattern, SPEC, [via_root])["V3"][0]
    assert v3.messages_on == ["outbox_new"]
    assert ("INSERT", "outbox_new") in {(s.event, s.relation) for s in v3.also}
