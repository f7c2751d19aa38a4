"""The publication marker's renderings (patterns/marker.py) and the pure decision that resolves
a flag's values from the settings or the column's DEFAULT (marker_catalog.decide).

Before, a flag column (eventuate-tram's `published smallint DEFAULT 0`, a `sent boolean`, a
status enum) was refused by `plan` ("published is smallint, not a timestamp") and every
predicate was written as `IS NULL` where it was needed.
"""

from __future__ import annotations

import dataclasses

import pytest

from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.errors import ConfigError
from outbox_migrate.patterns import marker
from outbox_migrate.patterns.marker_catalog import (
    Activity,
    Candidate,
    ColumnSample,
    Finding,
    MarkerColumn,
    candidate,
    choose,
    constant_default,
    decide,
    words,
)

TIMESTAMP = OutboxSpec()
SMALLINT = OutboxSpec(table="message", published_column="published", unpublished_value="0",
                      published_value="1")  # fmt: skip
STATUS = OutboxSpec(published_column="state", unpublished_value="PENDING",
                    published_value="PUBLISHED")  # fmt: skip
BESIDE = OutboxSpec(published_column="completion_date", status_column="status",
                    status_published_value="COMPLETED")  # fmt: skip


def text(composable: object) -> str:
    return composable.as_string(None)  # type: ignore[attr-defined,no-any-return]


def test_a_timestamp_renders_as_the_spec_always_did() -> None:
    assert text(marker.unpublished(TIMESTAMP)) == '"published_at" IS NULL'
    assert text(marker.unpublished(TIMESTAMP, "o")) == '"o"."published_at" IS NULL'
    assert text(marker.published(TIMESTAMP)) == '"published_at" IS NOT NULL'
    assert text(marker.mark(TIMESTAMP)) == '"published_at" = now()'
    assert text(marker.bound(TIMESTAMP)) == "FOR VALUES IN (NULL)"
    assert marker.bound_text(TIMESTAMP) == "FOR VALUES IN (NULL)"
    assert not marker.of(TIMESTAMP).is_flag


def test_a_flag_renders_its_values_as_literals() -> None:
    assert text(marker.unpublished(SMALLINT)) == "\"published\" = '0'"
    # the CHECK before the swap: implies NOT (published IS NOT NULL AND published = 0)
    assert text(marker.published(SMALLINT)) == ('"published" IS NOT NULL AND "published" <> \'0\'')
    assert text(marker.mark(SMALLINT)) == "\"published\" = '1'"
    assert text(marker.bound(SMALLINT)) == "FOR VALUES IN ('0')"
    assert marker.bound_text(SMALLINT) == "FOR VALUES IN (0)"
    assert marker.describe_unpublished(SMALLINT) == "published = 0"
    assert text(marker.unpublished(STATUS)) == "\"state\" = 'PENDING'"
    assert text(marker.mark(STATUS)) == "\"state\" = 'PUBLISHED'"


def test_a_quote_in_a_status_value_stays_inside_its_literal() -> None:
    odd = dataclasses.replace(STATUS, unpublished_value="it's new")
    assert text(marker.unpublished(odd)) == "\"state\" = 'it''s new'"


def test_the_mark_sets_a_status_column_beside_the_timestamp() -> None:
    assert text(marker.mark(BESIDE)) == '"completion_date" = now(), "status" = \'COMPLETED\''
    assert text(marker.unpublished(BESIDE)) == '"completion_date" IS NULL'


@pytest.mark.parametrize(
    ("default", "value"),
    [("0", "0"), ("false", "false"), ("'PENDING'::text", "PENDING"),
     ("'NEW'::character varying", "NEW"), ("'PENDING'::outbox_state", "PENDING"),
     ("'it''s'::text", "it's"), ("'-1'::integer", "-1"), ("(-1)", "-1"), ("now()", None),
     ("nextval('s'::regclass)", None), (None, None)],
)  # fmt: skip
def test_a_constant_default_is_read_and_an_expression_is_not(
    default: str | None, value: str | None
) -> None:
    assert constant_default(default) == value


def test_a_flags_values_come_from_its_default_and_the_obvious_published_value() -> None:
    spec = OutboxSpec(table="message", published_column="published")
    decided = decide(spec, MarkerColumn("smallint", "0", not_null=True), "message")
    assert isinstance(decided, OutboxSpec)
    assert (decided.unpublished_value, decided.published_value) == ("0", "1")
    flag = OutboxSpec(published_column="sent")
    decided = decide(flag, MarkerColumn("boolean", "false", not_null=True), "outbox")
    assert isinstance(decided, OutboxSpec)
    assert (decided.unpublished_value, decided.published_value) == ("false", "true")
    # a setting wins over the DEFAULT; a boolean is spelled as PostgreSQL prints it
    pinned = dataclasses.replace(flag, unpublished_value="f", published_value="yes")
    decided = decide(pinned, MarkerColumn("boolean", "true", not_null=True), "outbox")
    assert isinstance(decided, OutboxSpec)
    assert (decided.unpublished_value, decided.published_value) == ("false", "true")
    # an integer as PostgreSQL prints it in the partition bound
    padded = dataclasses.replace(spec, unpublished_value="00", published_value="+1")
    decided = decide(padded, MarkerColumn("smallint", None, not_null=True), "message")
    assert isinstance(decided, OutboxSpec)
    assert (decided.unpublished_value, decided.published_value) == ("0", "1")


def test_a_flag_that_could_be_null_is_refused_with_the_recipe() -> None:
    """A NULL flag would land in the DEFAULT (published) partition and never be relayed."""
    spec = OutboxSpec(table="message", published_column="published")
    refused = decide(spec, MarkerColumn("smallint", "0", not_null=False), "message")
    assert isinstance(refused, Finding)
    assert refused.code == "published-flag-nullable"
    assert 'ALTER TABLE "public"."message" ALTER COLUMN "published" SET NOT NULL' in refused.remedy
    assert refused.fix_sql in refused.remedy
    # a validated CHECK (published IS NOT NULL) is as good as NOT NULL
    checked = MarkerColumn("smallint", "0", not_null=False, not_null_check=True)
    assert isinstance(decide(spec, checked, "message"), OutboxSpec)
    # a relay of the flat table does not partition: it takes the nullable flag as it is
    relayed = decide(spec, MarkerColumn("smallint", "0", not_null=False), "message",
                     to_partition=False)  # fmt: skip
    assert isinstance(relayed, OutboxSpec) and relayed.unpublished_value == "0"


@pytest.mark.parametrize(
    ("spec", "column", "code"),
    [
        (OutboxSpec(published_column="state"), MarkerColumn("outbox_state", None, True),
         "published-flag-value"),
        (OutboxSpec(published_column="state"),
         MarkerColumn("outbox_state", "'PENDING'::outbox_state", True), "published-flag-value"),
        (OutboxSpec(published_column="n", published_value="0"),
         MarkerColumn("integer", "0", True), "published-flag-value"),
        (OutboxSpec(unpublished_value="0"),
         MarkerColumn("timestamp with time zone", None, False), "published-value"),
        (OutboxSpec(), MarkerColumn("timestamp with time zone", None, True),
         "published-not-null"),
        (OutboxSpec(), MarkerColumn("jsonb", None, True), "published-type"),
    ],
    ids=["no-default", "status-needs-published-value", "same-values", "timestamp-with-values",
         "timestamp-not-null", "jsonb"],
)  # fmt: skip
def test_what_cannot_be_a_marker_is_refused_with_what_to_set(
    spec: OutboxSpec, column: MarkerColumn, code: str
) -> None:
    refused = decide(spec, column, "outbox")
    assert isinstance(refused, Finding)
    assert refused.code == code
    assert refused.line().startswith("outbox.") or refused.line().startswith("published_value")


def test_status_column_and_its_value_go_together() -> None:
    settings = load_settings(
        {"status_column": "status", "status_published_value": "COMPLETED"}, environ={}
    )
    assert settings.spec.status_column == "status"
    with pytest.raises(ConfigError, match="status_published_value"):
        load_settings({"status_column": "status"}, environ={})
    with pytest.raises(ConfigError, match="must differ"):
        load_settings({"status_column": "published_at", "status_published_value": "x"}, environ={})


# -- evidence: which column records delivery, and whether rows leave by DELETE -------------

TS = "timestamp with time zone"


def sample(name: str, typ: str, default: str | None = None, not_null: bool = False,
           **seen: object) -> ColumnSample:  # fmt: skip
    return ColumnSample(name, typ, default, not_null, **seen)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("column", "kind"),
    [
        (sample("published", "smallint", "0"), "flag"),
        (sample("acked", "boolean", "false", True), "flag"),
        (sample("flag", "smallint", "0", rows=4, values=("0", "1"), distinct=2), "flag"),
        (sample("DispatchedAt", TS), "timestamp"),
        (sample("happened", TS, rows=4, nulls=2, values=("x",), distinct=1), "timestamp"),
        (sample("StatusName", "character varying(50)", None, True), "status"),
        # ruled out by type, default or contents, whatever the name
        (sample("published_at", TS, not_null=True), None),
        (sample("published_at", TS, "now()"), None),
        (sample("sent_at", TS, rows=3, nulls=1, distinct=2, ahead=True), None),
        (sample("published", "smallint"), None),
        (
            sample(
                "published",
                "smallint",
                "0",
                rows=9,
                distinct=6,
                values=("0", "1", "2", "3", "4", "5"),
            ),
            None,
        ),
        (sample("published", "jsonb", "'{}'::jsonb"), None),
        # a deadline or a counter is never suggested; an unnamed column must be seen at work
        (sample("deliver_by", TS), None),
        (sample("ExpiresAt", "timestamp without time zone"), None),
        (sample("attempts", "integer", "0", rows=5, values=("0", "1"), distinct=2), None),
        (sample("EnqueueTime", TS, rows=4, nulls=2, distinct=1), None),
        (sample("flag", "smallint", "0", rows=4, values=("0",), distinct=1), None),
        (sample("happened", TS, rows=4, nulls=4), None),
    ],
)
def test_a_marker_is_recognised_from_type_default_and_contents(
    column: ColumnSample, kind: str | None
) -> None:
    found = candidate(column)
    assert (found.kind if found else None) == kind


def test_one_column_is_chosen_only_when_the_evidence_names_one() -> None:
    flag = Candidate("published", "flag", "", named=True)
    stamp = Candidate("delivered_at", "timestamp", "", named=True)
    unnamed = Candidate("happened", "timestamp", "", named=False)
    status = Candidate("StatusName", "status", "", named=True)
    assert choose([flag]) == flag
    assert choose([flag, unnamed]) == flag
    assert choose([unnamed]) == unnamed
    assert choose([flag, stamp]) is None  # two that record delivery: the user picks
    assert choose([status]) is None  # its values must be set
    assert choose([]) is None


@pytest.mark.parametrize(
    ("activity", "deletes"),
    [
        (Activity(150, 0, 120), True),  # Wolverine, MassTransit: sent rows deleted, unmarked
        (Activity(150, 150, 120), False),  # retention after the relay's mark
        (Activity(150, 0, 99), False),  # too few deletes to say
        (Activity(1000, 0, 300), False),  # most rows still there
        (Activity(0, 0, 0), False),
    ],
)
def test_delete_on_delivery_is_read_from_the_tables_counters(
    activity: Activity, deletes: bool
) -> None:
    assert activity.deletes_on_delivery() is deletes


def test_words_split_snake_and_camel_case() -> None:
    assert words("DispatchedAt") == ["dispatched", "at"]
    assert words("deliver_by") == ["deliver", "by"]
    assert words("StatusName") == ["status", "name"]
    assert words("ID_2") == ["id", "2"]
