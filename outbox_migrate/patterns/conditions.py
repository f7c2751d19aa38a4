"""Condition factories: a named query from `sql/conditions.sql`, bound to concrete names."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import replace

from psycopg import sql

from outbox_migrate import sql as queries
from outbox_migrate.patterns import marker
from outbox_migrate.patterns.model import CheckPoint, Condition
from outbox_migrate.patterns.names import Names, gate_lock_keys


def condition(
    name: str, label: str = "", file: str = "conditions", /, **parts: sql.Composable
) -> Condition:
    """Bind the query `name` of `sql/<file>.sql`; `label` distinguishes several uses of one
    query. It is checked under the step's locks (`CheckPoint.LOCKED`) unless `before_lock`
    says otherwise."""
    named = queries.query(file, name)
    return Condition(
        name=f"{name}:{label}" if label else name,
        description=named.description,
        query=named.compose(**parts),
    )


def before_lock(condition: Condition, at: CheckPoint, kept_by: str) -> Condition:
    """The same check, evaluated before the step's transaction; `kept_by` names what keeps
    its result true until commit (shown by `plan`)."""
    return replace(condition, at=at, kept_by=kept_by)


def sample_key(n: Names, relation: str, prefix: str = "gate") -> sql.Literal:
    """The session setting where a gate's sample of `relation` is remembered until the
    step's lock (the runner makes both on one session)."""
    key = zlib.crc32(n.reg(relation).as_string(None).encode()) & 0xFFFFFFFF
    return sql.Literal(f"outbox_migrate.{prefix}_{key:08x}")


def _on_relation(name: str, *, parent: bool = False) -> Callable[[Names, str], Condition]:
    """The factory of a query that names only its relation (and, with `parent`, the parent)."""

    def bound(n: Names, relation: str) -> Condition:
        parts = {"rel_reg": n.reg(relation)} | ({"parent_reg": n.reg(n.parent)} if parent else {})
        return condition(name, relation, **parts)

    return bound


relation_exists = _on_relation("relation-exists")
relation_absent = _on_relation("relation-absent")
is_plain_table = _on_relation("is-plain-table")
no_partitions = _on_relation("no-partitions")
no_fk_references = _on_relation("no-fk-references")
no_enabled_user_triggers = _on_relation("no-enabled-user-triggers")
not_a_partition = _on_relation("not-a-partition-of", parent=True)
columns_match = _on_relation("columns-match", parent=True)


def partitioned_by_list(n: Names) -> Condition:
    return condition(
        "partitioned-by-list",
        n.parent,
        rel_reg=n.reg(n.parent),
        column_name=sql.Literal(n.spec.published_column),
    )


def partition_bound(n: Names, relation: str, bound: str) -> Condition:
    # A flag's bound holds its value; its text depends on the column's type (`'0'`,
    # `false`), so it is compared without quotes by a query of its own.
    flag = bound == marker.NULL_BOUND and marker.of(n.spec).is_flag
    return condition(
        "partition-bound-value" if flag else "partition-bound",
        relation,
        rel_reg=n.reg(relation),
        parent_reg=n.reg(n.parent),
        bound=sql.Literal(marker.bound_text(n.spec) if flag else bound),
    )


def marker_kind(n: Names, relation: str) -> Condition:
    """Steps built without a database (Alembic revisions, `plan` offline) take the marker
    from the settings alone: a flag table built as a timestamp one would get a NULL partition
    its rows never enter, so the partition's creation checks the column first."""
    flag = marker.of(n.spec).is_flag
    return condition(
        "marker-kind",
        relation,
        rel_reg=n.reg(relation),
        column_name=sql.Literal(n.spec.published_column),
        is_timestamp=sql.Literal(not flag),
        kind=sql.Literal("flag" if flag else "timestamp (NULL = unpublished)"),
        remedy=sql.Literal(
            "set published_column to the timestamp"
            if flag
            else "set unpublished_value and published_value (or build the steps with a "
            "database, which reads the flag's DEFAULT)"
        ),
    )


def unpublished_index_exists(n: Names) -> Condition:
    return condition(
        "index-exists",
        n.spec.unpublished_index,
        index_reg=n.reg(n.spec.unpublished_index),
        rel_reg=n.reg(n.unpublished),
    )


def drained(n: Names, relation: str, phase: str) -> Condition:
    return condition(
        "old-table-drained",
        relation,
        rel_reg=n.reg(relation),
        rel_q=n.q(relation),
        unpublished=marker.unpublished(n.spec),
        phase=sql.Literal(phase),
    )


def no_unread_rows(n: Names, phase: str) -> Condition:
    """No unpublished row waits in the flat table where it stands alone — under its name or
    retired (`<table>_retired`) — once no relay reads it: such a row is never sent. Either
    may be absent, so the count is made through `query_to_xml` (a plain SELECT cannot name a
    table that may not exist, and a condition must stay a SELECT for offline SQL)."""
    return condition(
        "no-unread-rows",
        n.table,
        rel_reg=n.reg(n.table),
        retired_reg=n.reg(n.spec.retired_table),
        unpublished_text=sql.Literal(marker.unpublished(n.spec).as_string(None)),
        phase=sql.Literal(phase),
    )


def _gate_parts(n: Names, relation: str, phase: str) -> dict[str, sql.Composable]:
    key1, key2 = gate_lock_keys(n)
    return {
        "rel_reg": n.reg(relation),
        "seq_reg": n.reg(n.spec.gate_sequence),
        "key1": key1,
        "key2": key2,
        "phase": sql.Literal(phase),
        "sample_key": sample_key(n, relation),
    }


def no_new_ticks(n: Names, relation: str, phase: str, window_s: float) -> Condition:
    """The deploy gate's window on the gate sequence (see kinds/gate_sequence.py)."""
    sampled = condition(
        "no-new-ticks", relation, window_s=sql.Literal(window_s), **_gate_parts(n, relation, phase)
    )
    return before_lock(sampled, CheckPoint.SAMPLED, f"no-new-ticks-since-sample:{relation}")


def no_new_ticks_since_sample(n: Names, relation: str, phase: str) -> Condition:
    """Under the step's lock: no insert statement ended since the window, and no transaction
    that inserted is still open."""
    return condition("no-new-ticks-since-sample", relation, **_gate_parts(n, relation, phase))


def no_old_app_sessions(pattern: str, phase: str) -> Condition:
    return condition("no-old-app-sessions", pattern=sql.Literal(pattern), phase=sql.Literal(phase))


def _check_parts(n: Names) -> dict[str, sql.Composable]:
    return {"rel_reg": n.reg(n.table), "check_name": sql.Literal(n.spec.check_name)}


def _on_check(name: str) -> Callable[[Names], Condition]:
    return lambda n: condition(name, **_check_parts(n))


check_exists = _on_check("check-exists")
check_validated = _on_check("check-validated")
check_absent = _on_check("check-absent")


def check_implies_partition_constraint(n: Names) -> Condition:
    """The flag's query also needs the unpublished value (the timestamp's ignores it)."""
    flag = marker.of(n.spec)
    return condition(
        "check-implies-partition-constraint" + ("-flag" if flag.is_flag else ""),
        column_name=sql.Literal(n.spec.published_column),
        value=sql.Literal(flag.unpublished_value),
        **_check_parts(n),
    )


def column_not_null(n: Names) -> Condition:
    return condition(
        "column-not-null",
        rel_reg=n.reg(n.table),
        column_name=sql.Literal(n.spec.published_column),
    )


def no_identity(n: Names, relation: str) -> Condition:
    return condition(
        "no-identity",
        relation,
        rel_reg=n.reg(relation),
        column_name=sql.Literal(n.spec.id_column),
    )


def new_ids_above_old(n: Names) -> Condition:
    return condition(
        "new-ids-above-old",
        parent_reg=n.reg(n.parent),
        rel_reg=n.reg(n.table),
        rel_seq=n.id_sequence(n.table),
        rel_q=n.q(n.table),
        id_q=n.id_q,
        id_name=sql.Literal(n.spec.id_column),
    )


def on_trigger(query: str, n: Names, relation: str, trigger: str, label: str = "") -> Condition:
    return condition(query, label, rel_reg=n.reg(relation), trigger_name=sql.Literal(trigger))


def trigger_exists(n: Names) -> Condition:
    return on_trigger("trigger-exists", n, n.published, n.spec.copy_trigger)


def trigger_absent(n: Names) -> Condition:
    return on_trigger("trigger-absent", n, n.published, n.spec.copy_trigger)


def function_absent(n: Names, function: str = "") -> Condition:
    """The function `function` (default: HOPIA's copy function, unlabelled) is gone."""
    return condition(
        "function-absent", function, function_reg=n.reg(function or n.spec.copy_function)
    )


AUTOVACUUM_INSERT_ONLY: tuple[tuple[str, str], ...] = (
    ("autovacuum_vacuum_insert_scale_factor", "0"),
    ("autovacuum_vacuum_insert_threshold", "100000"),
    ("autovacuum_analyze_scale_factor", "0"),
    ("autovacuum_analyze_threshold", "100000"),
)
"""The spec's settings for the insert-only published partition: vacuum and analyze every
100 k inserted rows regardless of size (PostgreSQL's defaults scale with table size)."""


def autovacuum_tuned(n: Names, relation: str) -> Condition:
    wanted = [f"{key}={value}" for key, value in AUTOVACUUM_INSERT_ONLY]
    return condition(
        "autovacuum-tuned", relation, rel_reg=n.reg(relation), settings=sql.Literal(wanted)
    )


def all_rows_present(n: Names, source: str, target: str, kept_by: str = "") -> Condition:
    """A scan of the whole source: checked before the step's transaction; `kept_by` says what
    keeps it true until commit (the source detached and locked, or the copy trigger)."""
    scan = condition(
        "all-rows-present-by-order" if n.spec.id_kind == "application" else "all-rows-present",
        f"{source}->{target}",
        source_reg=n.reg(source),
        source_q=n.q(source),
        rel_reg=n.reg(target),
        rel_q=n.q(target),
        id_q=n.id_q,
    )
    kept = kept_by or f"{source} is locked ACCESS EXCLUSIVE and detached: no row can arrive"
    return before_lock(scan, CheckPoint.SCAN, kept)


def no_trigger_name_clash(n: Names) -> Condition:
    """ATTACH clones the parent's row triggers onto the old table and fails on a name it
    already uses. Checked under the step's locks, which keep CREATE TRIGGER out until commit
    (SHARE ROW EXCLUSIVE conflicts with both ACCESS EXCLUSIVE and SHARE UPDATE EXCLUSIVE)."""
    return condition("no-trigger-name-clash", rel_reg=n.reg(n.table), parent_reg=n.reg(n.parent))


def relation_empty(n: Names, relation: str) -> Condition:
    return condition("relation-empty", relation, rel_reg=n.reg(relation), rel_q=n.q(relation))


def unique_id_index(n: Names, relation: str) -> Condition:
    return condition(
        "unique-id-index",
        relation,
        rel_reg=n.reg(relation),
        id_name=sql.Literal(n.spec.id_column),
    )
