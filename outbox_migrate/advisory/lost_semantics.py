"""What a flat outbox means that the partitioned layout cannot keep (a unique MessageId, `ctid`
in a cleanup, row locks, a status beside the timestamp), judged for `plan` and so for `run`'s
admission. One catalog query, otherwise no I/O; ids, CHECKs and triggers are introspect.py's.
"""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING, Any

from psycopg import Connection

from outbox_migrate import sql as queries
from outbox_migrate.advisory import Finding
from outbox_migrate.advisory.table_facts import UniqueKey
from outbox_migrate.config import OutboxSpec
from outbox_migrate.db import GUARD_SETTING
from outbox_migrate.patterns.kinds.guard import COST as GUARD_COST
from outbox_migrate.patterns.marker_catalog import TIMESTAMP_TYPES
from outbox_migrate.patterns.names import Names

if TYPE_CHECKING:
    from outbox_migrate.advisory.table_facts import ColumnFact, TableFacts

MARKER_STEMS = (
    "publish", "dispatch", "sent", "deliver", "process", "relay", "complet", "handled", "emit",
)  # fmt: skip
"""Name fragments of a column that records delivery (`published_at`, `Dispatched`,
`ProcessedDate`, `completion_date`): what tells a misnamed marker from no marker at all."""
STATUS_NAMES = ("status", "state")
"""A column named so, or ending `_status`/`_state`, is read as a message's status."""
KINDS = {"p": "primary key", "u": "unique constraint", "": "unique index"}
LAYOUT_WARNINGS = ("ctid-guarded", "mark-moves-row")
"""Warnings every table gets, last: what changes for any code that touches the rows (with
the unpublished-row guard, the default; without it the first is `ctid-per-partition`)."""


def read_unique_keys(conn: Connection[Any], spec: OutboxSpec) -> list[UniqueKey]:
    rows = conn.execute(
        queries.query("semantics", "unique-keys").compose(rel_reg=Names(spec).reg(spec.table))
    ).fetchall()
    return [
        UniqueKey(str(name), "primary key" if primary else KINDS.get(contype, "unique index"),
                  tuple(columns), bool(partial), str(definition))
        for name, primary, contype, columns, partial, definition in rows
    ]  # fmt: skip


def id_unique_by_construction(facts: TableFacts, spec: OutboxSpec) -> bool:
    """Generated ids (identity, sequence, uuid default) stay unique without an index; ids the
    application supplies were kept unique by the index alone. A uuid or text id is judged
    application-supplied before id_kind says so, so this blocker comes in the same round as
    the one asking for id_kind."""
    if spec.id_kind != "application" and facts.id_kind(spec) != "application":
        return True
    column = facts.column(spec.id_column)
    return column is not None and column.default is not None


def lost_unique_keys(facts: TableFacts, spec: OutboxSpec) -> list[UniqueKey]:
    """Unique keys whose rule the partitioned table cannot enforce: their columns include
    neither the partition key (then it could be re-created on the parent) nor an id that is
    unique by construction."""
    keep = {spec.published_column}
    if id_unique_by_construction(facts, spec):
        keep.add(spec.id_column)
    if facts.column(spec.id_column) is None:
        # id-missing suggests the primary key as the id: judged as if it were set
        keep.update(facts.primary_key())
    return [key for key in facts.unique_keys if not keep.intersection(key.columns)]


def judge_lost_semantics(facts: TableFacts, spec: OutboxSpec, table: str) -> None:
    """Blockers for rules that would silently stop holding; warnings for behaviour that
    changes for code outside outbox-migrate. A table without its publication column is
    refused for that alone (marker_judge.missing_marker): it will not be partitioned, so
    nothing is lost."""
    if facts.column(spec.published_column) is None:
        return
    parent, published = spec.partitioned_table, spec.published_column
    for key in lost_unique_keys(facts, spec):
        enforced = (
            f"{key.kind} {key.name} on {table} ({key.shown()}"
            + (", partial" if key.partial else "")
            + f") keeps two rows from sharing {key.shown()}"
        )
        lost = (
            f"; {parent} cannot: a unique index on a partitioned table must include the "
            f"partition key ({published}), so after the migration a duplicate commits"
        )
        if key.name in spec.accept_lost_unique:
            facts.warnings.append(Finding(
                "lost-unique-accepted", enforced + lost,
                "accepted (accept_lost_unique): the rule must now be kept elsewhere, e.g. a "
                "deduplication table the application writes in the same transaction",
            ))  # fmt: skip
            continue
        facts.blockers.append(Finding(
            "lost-unique", enforced + lost,
            "if the application relies on it (deduplication), keep the rule in a table of "
            "its own with that key, written in the same transaction as the outbox row "
            "(docs/patterns.md, \"Your table is not the spec's\"); then accept the loss: "
            f"accept_lost_unique = [{json.dumps(key.name)}] "
            f"(--accept-lost-unique {shlex.quote(key.name)})",
        ))  # fmt: skip
    status = status_beside_timestamp(facts, spec)
    if status is not None and not spec.status_column:
        facts.warnings.append(Finding(
            "status-column-beside",
            f"{table}.{status.name} ({status.type}) looks like a status column beside the "
            f"publication timestamp {published}",
            f"the relay sets only {published}, so {status.name} keeps the value the "
            "application wrote, and a framework that reads it re-submits every relayed "
            f"message; have the relay set it too: status_column = \"{status.name}\" and "
            "status_published_value = the framework's published value (e.g. "
            f"--status-column {status.name} --status-published-value COMPLETED), or keep "
            "publishing with the framework's own publisher",
        ))  # fmt: skip
    facts.warnings.append(ctid_finding(spec))
    facts.warnings.append(Finding(
        "mark-moves-row",
        f"marking a row published moves it to another partition of {parent}",
        "a second session that locks or updates the row meanwhile (SELECT … FOR UPDATE, an "
        "application's own publisher marking the same row) no longer waits for it: it gets "
        "SQLSTATE 40001 (serialization_failure: \"tuple to be locked was already moved to "
        "another partition due to concurrent update\"); retry that transaction on 40001 "
        "(outbox-migrate's relay does)",
    ))  # fmt: skip


def ctid_finding(spec: OutboxSpec) -> Finding:
    """What a ctid means on the partitioned table: with the guard (`unpublished_guard`, the
    default), a DELETE by ctid loses no unsent message, and `plan` names the guard, its cost
    and its escape hatch; without it, the same cleanup deletes unsent messages."""
    parent, unpublished = spec.partitioned_table, spec.unpublished_partition
    message = f"ctid is unique only within one partition of {parent}"
    by_id = f"select by {spec.id_column} instead, or run it on one partition"
    if not spec.unpublished_guard:
        return Finding(
            "ctid-per-partition",
            message,
            f"a statement that selects ctids and then deletes or updates `WHERE ctid IN (…)` "
            f"on {parent} (a framework's batched cleanup) also hits rows of the other "
            f"partition that have the same ctid, unpublished ones included: {by_id}; or keep "
            "unpublished_guard on (the default)",
        )
    return Finding(
        "ctid-guarded",
        f"{message}: the guard {spec.guard_function} (a DELETE trigger on {parent} and "
        f"{unpublished}) writes back the unpublished rows any session but outbox-migrate's "
        "deletes, so a cleanup `DELETE … WHERE ctid IN (…)` removes only the published rows "
        "it selected",
        f"{GUARD_COST}; an application that deletes an unsent message on purpose keeps "
        f"it unless it runs SET LOCAL {GUARD_SETTING} = off in that transaction "
        f"(unpublished_guard = false builds no guard); an UPDATE `WHERE ctid IN (…)` is not "
        f"guarded: {by_id}",
    )


def status_beside_timestamp(facts: TableFacts, spec: OutboxSpec) -> ColumnFact | None:
    """The first column that looks like a message status next to the publication timestamp:
    named `status`/`state` (or `…_status`/`…_state`), or a boolean named like a delivery
    marker (NServiceBus's `Dispatched`). A guess by name, stated as one in the warning."""
    for column in facts.columns:
        if column.name in (spec.id_column, spec.published_column, spec.status_column):
            continue
        if column.type in TIMESTAMP_TYPES:
            continue
        lowered = column.name.lower()
        named = lowered in STATUS_NAMES or lowered.endswith(tuple(f"_{s}" for s in STATUS_NAMES))
        flag = column.type == "boolean" and any(stem in lowered for stem in MARKER_STEMS)
        if named or flag:
            return column
    return None
