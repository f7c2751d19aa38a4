"""What `plan` says about the publication marker: a flag's values, why a column cannot be the
marker, which partial index serves the relay, and whether the table has a marker at all or
deletes what it delivers. Judged from `TableFacts` (decisions in marker_catalog); no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outbox_migrate.advisory import Finding
from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import marker, marker_catalog
from outbox_migrate.patterns.names import Names

if TYPE_CHECKING:
    from outbox_migrate.advisory.table_facts import TableFacts


def column_of(facts: TableFacts, spec: OutboxSpec) -> marker_catalog.MarkerColumn | None:
    column = facts.column(spec.published_column)
    if column is None:
        return None
    checks = {f"CHECK (({name} IS NOT NULL))" for name in (column.name, f'"{column.name}"')}
    by_check = any(d in checks and valid for _n, d, valid, _ni in facts.check_details)
    return marker_catalog.MarkerColumn(column.type, column.default, column.not_null, by_check)


def marker_spec(facts: TableFacts, spec: OutboxSpec) -> OutboxSpec | None:
    """The spec with its marker resolved from the column (a flag's values), or None when the
    column is missing or cannot be a marker (`judge_marker` says why)."""
    column = column_of(facts, spec)
    if column is None:
        return None
    decided = marker_catalog.decide(spec, column, Names(spec).display(spec.table))
    return None if isinstance(decided, Finding) else decided


def judge_marker(facts: TableFacts, spec: OutboxSpec, table: str) -> OutboxSpec:
    """A blocker when the (present) column cannot be the marker; a note naming a flag's
    values. Returns the spec the rest of the judgement goes on with (a flag's values filled)."""
    column = column_of(facts, spec)
    if column is None:
        return spec
    if facts.detected_marker == spec.published_column:
        why = next((c.why for c in candidates(facts, spec) if c.name == spec.published_column),
                   column.type)  # fmt: skip
        facts.notes.append(Finding(
            "marker-detected",
            f"{table}.{spec.published_column} records delivery: {why}",
            f'published_column is not set and {table} has no {OutboxSpec.published_column}, so '
            "every command takes this column; set published_column to pin it",
        ))  # fmt: skip
    sample = facts.sample(spec.published_column)
    if column.type in marker_catalog.TIMESTAMP_TYPES and sample is not None and sample.ahead:
        facts.blockers.append(Finding(
            "published-ahead",
            f"{table}.{spec.published_column} holds times later than now: a deadline or a "
            "schedule, not when a row was published",
            "set published_column to the column the sender sets when it delivers a row; if "
            "none does, this outbox deletes what it delivers and there is nothing to partition",
        ))  # fmt: skip
        return spec
    decided = marker_catalog.decide(spec, column, table)
    if isinstance(decided, Finding):
        facts.blockers.append(decided)
        return spec
    if decided.unpublished_value:
        facts.notes.append(Finding(
            "flag-marker",
            f"{table}.{spec.published_column} is a flag: "
            f"{marker.describe_unpublished(decided)} is unpublished, the relay sets "
            f"{decided.published_value}",
            f"the unpublished partition is {marker.bound_text(decided)}; pin the values with "
            "unpublished_value and published_value if the DEFAULT may change",
        ))  # fmt: skip
    return decided


def serves_the_relay(definition: str, spec: OutboxSpec) -> bool:
    """A partial index on the unpublished rows: `WHERE (published_at IS NULL)`, or for a flag
    any predicate on the flag (`WHERE (published = 0)`, `WHERE (NOT sent)`)."""
    published = spec.published_column
    if not marker.of(spec).is_flag:
        return f"({published} IS NULL)" in definition
    _, where, predicate = definition.partition(" WHERE ")
    return bool(where) and published in predicate


def candidates(facts: TableFacts, spec: OutboxSpec) -> list[marker_catalog.Candidate]:
    """The columns whose type, default and contents fit a marker (without rows read, the
    catalog alone: a pure judgement of a table nobody sampled)."""
    found = []
    for column in facts.columns:
        if column.name == spec.id_column or column.generated:
            continue
        sample = facts.sample(column.name) or marker_catalog.ColumnSample(
            column.name, column.type, column.default, column.not_null
        )
        judged = marker_catalog.candidate(sample)
        if judged is not None:
            found.append(judged)
    return found


def deletes_on_delivery(facts: TableFacts, table: str) -> Finding:
    """The refusal when the table's own counters show rows leaving by DELETE, unmarked: what
    a published_column names there is not a delivery record (Wolverine's `deliver_by`)."""
    return Finding(
        "delete-on-delivery",
        f"{table} deletes the rows it delivers: {facts.activity.said()}",
        "this outbox deletes delivered rows: there is nothing to partition (it holds only "
        "undelivered messages and stays small by itself), whatever published_column names",
    )


def missing_marker(facts: TableFacts, spec: OutboxSpec, table: str) -> Finding:
    """The refusal when the publication column is absent: the columns that could be the
    marker by their type, default and contents, each with its setting; with none, an outbox
    that deletes what it delivers (MassTransit's OutboxMessage, Debezium's example), where
    "set published_column" would invite a wrong fix."""
    found = candidates(facts, spec)
    missing = f"{table} has no column {spec.published_column!r}"
    if found:
        code = "status-column" if all(c.kind == "status" for c in found) else "published-missing"
        listed = "; or ".join(f"{c.setting()} ({c.why})" for c in found)
        which = "the column" if len(found) == 1 else "the one of these"
        return Finding(
            code,
            missing,
            f"set {which} the sender sets on delivery: {listed}; see docs/patterns.md, "
            '"Your table is not the spec\'s"',
        )
    return Finding(
        "delete-on-delivery",
        f"{table} has no publication marker: no column {spec.published_column!r}, and no "
        "nullable timestamp without a default or flag with a constant default that could "
        "record delivery",
        "this outbox deletes delivered rows: there is nothing to partition (it holds only "
        "undelivered messages and stays small by itself); if a column does record "
        "publication, set published_column to it",
    )
