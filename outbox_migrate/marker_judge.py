"""What `plan` says about the publication marker, judged from `TableFacts` without I/O: a
flag's values (a note), or why the column cannot be the marker (a blocker), and which partial
index of the old table serves the relay. The decision itself is marker_catalog.decide; this
module must not read the database.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outbox_migrate import marker_catalog
from outbox_migrate.config import OutboxSpec
from outbox_migrate.findings import Finding
from outbox_migrate.patterns import marker

if TYPE_CHECKING:
    from outbox_migrate.table_facts import TableFacts


def shown(spec: OutboxSpec) -> str:
    """The table as messages name it: schema-qualified only outside `public`."""
    return spec.table if spec.schema == "public" else f"{spec.schema}.{spec.table}"


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
    decided = marker_catalog.decide(spec, column, shown(spec))
    return None if isinstance(decided, marker_catalog.Refusal) else decided


def judge_marker(facts: TableFacts, spec: OutboxSpec, table: str) -> OutboxSpec:
    """A blocker when the (present) column cannot be the marker; a note naming a flag's
    values. Returns the spec the rest of the judgement goes on with (a flag's values filled)."""
    column = column_of(facts, spec)
    if column is None:
        return spec
    decided = marker_catalog.decide(spec, column, table)
    if isinstance(decided, marker_catalog.Refusal):
        facts.blockers.append(Finding(decided.code, decided.message, decided.remedy))
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
