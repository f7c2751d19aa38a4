"""Read the live outbox into `TableFacts`, and judge what stands in the migration's way:
blockers (each with what to do) and warnings. Read-only: catalog queries plus `max(id)` and an
exact unpublished count (cheap thanks to the relay's partial index).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from psycopg import Connection, sql

from outbox_migrate import sql as queries
from outbox_migrate.advisory import Finding, id_judge, ident, marker_judge
from outbox_migrate.advisory import lost_semantics as lost_rules
from outbox_migrate.advisory.table_facts import (
    ASSUMED_SCAN_BYTES_PER_S,
    ID_TYPES,
    ColumnFact,
    ObjectFact,
    TableFacts,
)
from outbox_migrate.advisory.table_privileges import read_table_privileges
from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import Blocked, SchemaError
from outbox_migrate.patterns import marker, marker_catalog
from outbox_migrate.patterns.model import PublicationFact
from outbox_migrate.patterns.names import Names


def _rows(conn: Connection[Any], name: str, **parts: sql.Composable) -> list[tuple[Any, ...]]:
    return list(conn.execute(queries.query("introspect", name).compose(**parts)).fetchall())


def publication_facts(conn: Connection[Any], spec: OutboxSpec) -> tuple[PublicationFact, ...]:
    """The publications covering the old table, for the catalog's conditional step (and
    `plan`'s CDC view). PostgreSQL 14 has no row filters, column lists or schema
    publications, hence its own query."""
    name = "publication-details" if conn.info.server_version >= 150000 else "publication-details-14"
    rows = _rows(conn, name, rel_reg=Names(spec).reg(spec.table))
    return tuple(
        PublicationFact(
            name=str(pub), explicit=bool(explicit), all_tables=bool(all_tables),
            by_schema=bool(by_schema), via_root=bool(via_root), insert=bool(ins),
            update=bool(upd), delete=bool(dele), row_filter=row_filter,
            columns=tuple(columns) if columns else None,
        )
        for pub, explicit, all_tables, by_schema, via_root, ins, upd, dele, row_filter, columns
        in rows
    )  # fmt: skip


def introspect(conn: Connection[Any], spec: OutboxSpec, pattern: str = "") -> TableFacts:
    """Read the facts; raise `SchemaError` when the table does not exist at all. `pattern`
    (optional) turns what only that pattern needs into blockers."""
    n = Names(spec)
    rel = {"rel_reg": n.reg(spec.table)}
    table_rows = _rows(conn, "table", **rel)
    if not table_rows:
        raise SchemaError(
            f"table {n.display(spec.table)} does not exist in database "
            f"{conn.info.dbname!r}; check --schema/--table (outbox-migrate config)"
        )
    relkind, is_partition, total, heap, estimate, inserts, updates, deletes = table_rows[0]
    columns = [
        ColumnFact(name, typ, default, notnull, coll, ident, gen)
        for name, typ, _base, default, notnull, coll, ident, gen in _rows(conn, "columns", **rel)
    ]
    version_row = conn.execute("SHOW server_version").fetchone()
    facts = TableFacts(
        schema=spec.schema,
        table=spec.table,
        server_version=conn.info.server_version // 10000,
        server_version_text=str(version_row[0]) if version_row else "?",
        relkind=relkind,
        is_partition=bool(is_partition),
        columns=columns,
        row_estimate=int(estimate),
        total_bytes=int(total),
        heap_bytes=int(heap),
        inserts=int(inserts),
        foreign_keys_in=[(r[0], r[1]) for r in _rows(conn, "foreign-keys-in", **rel)],
        foreign_keys_out=[(r[0], r[1]) for r in _rows(conn, "foreign-keys-out", **rel)],
        publications=[r[0] for r in _rows(conn, "publications", **rel)],
        publication_details=list(publication_facts(conn, spec)),
        updates=int(updates),
        deletes=int(deletes),
    )
    for name, definition, _valid, _size, primary, unique, _con in _rows(conn, "indexes", **rel):
        facts.indexes.append((name, definition))
        facts.index_details.append((name, definition, primary, unique, _valid))
    for name, contype, definition, validated, noinherit in _rows(conn, "constraints", **rel):
        facts.constraints.append((name, definition, bool(validated)))
        if contype == "c":
            facts.check_details.append((name, definition, bool(validated), bool(noinherit)))
    for name, definition, enabled, _type in _rows(conn, "triggers", **rel):
        facts.triggers.append((name, definition))
        facts.trigger_details.append((name, definition, enabled))
    facts.unique_keys = lost_rules.read_unique_keys(conn, spec)
    # What the columns hold (bounded), and the marker the evidence names when the setting
    # was left at its default and the table has no such column.
    facts.samples, _counters = marker_catalog.read_samples(
        conn, spec.schema, spec.table, (spec.id_column,)
    )
    spec = marker_from_samples(facts, spec)
    id_col = facts.column(spec.id_column)
    if id_col is not None and id_col.type in ID_TYPES:
        ids = _rows(
            conn,
            "ids",
            rel_reg=n.reg(spec.table),
            rel_q=n.q(spec.table),
            rel_seq=n.id_sequence(spec.table),
            id_q=n.id_q,
            id_name=sql.Literal(spec.id_column),
        )[0]
        facts.max_id, facts.sequence, facts.sequence_last_value, facts.sequence_owned = ids
    elif id_col is not None and id_col.type == "uuid":
        facts.random_uuid_ids = bool(
            _rows(conn, "uuid-random", rel_q=n.q(spec.table), id_q=n.id_q)[0][0]
        )
    resolved = marker_judge.marker_spec(facts, spec)
    value_problem = (
        ""
        if resolved is None
        else marker_catalog.check_values(conn, resolved, spec.table, n.display(spec.table))
    )
    if resolved is not None and not value_problem:
        facts.unpublished = int(
            _rows(
                conn, "unpublished", rel_q=n.q(spec.table), unpublished=marker.unpublished(resolved)
            )[0][0]
        )
        # The count is exact, the estimate may be stale: never fewer rows than unpublished ones.
        facts.row_estimate = max(facts.row_estimate, facts.unpublished)
        spec = resolved
    for relation in (spec.partitioned_table, spec.unpublished_partition, spec.published_partition):
        found = _rows(conn, "relation-kind", rel_reg=n.reg(relation))
        if found:
            kind, parent, bound = found[0]
            facts.new_table_state[relation] = (
                f"partition of {parent} {bound}"
                if parent
                else {"p": "partitioned table"}.get(kind, "table")
            )
    judge(facts, spec, pattern)
    facts.blockers += _names_taken(conn, spec, list(facts.new_table_state))
    seen = read_table_privileges(conn, spec)  # what travels to the new tables (plan shows it)
    facts.objects[:0] = [ObjectFact(*o) for o in seen.objects(spec, pattern)]
    facts.blockers += [Finding(*b) for b in seen.blockers(spec)]
    if value_problem:
        facts.blockers.append(Finding("published-value", value_problem, "fix the setting"))
    return facts


_NAME_OPTIONS = {
    "partitioned_table": "--partitioned-table",
    "unpublished_partition": "--unpublished-partition",
    "published_partition": "--published-partition",
}


def _names_taken(conn: Connection[Any], spec: OutboxSpec, existing: list[str]) -> list[Finding]:
    """The relations this migration would create that another table's live migration made
    (the ledger's `owned_object`, by OID): its first step could only refuse, and the way out
    is a name of this migration's own. Skipped when the ledger is absent or unreadable
    (`plan` needs no grant on it); this table's own migrations are the runner's business."""
    readable = conn.execute(
        "SELECT count(*) = 2 AND bool_and(has_schema_privilege(n.oid, 'USAGE') "
        "AND has_table_privilege(c.oid, 'SELECT')) FROM pg_class c JOIN pg_namespace n "
        "ON n.oid = c.relnamespace WHERE n.nspname = 'outbox_migrate' "
        "AND c.relname IN ('migration', 'owned_object')"
    ).fetchone()
    if not existing or not (readable and readable[0]):
        return []
    taken: dict[str, tuple[list[str], list[str]]] = {}  # owner -> (relations, options)
    for key, option in _NAME_OPTIONS.items():
        relation = getattr(spec, key)
        if relation not in existing:
            continue
        row = conn.execute(
            "SELECT upper(m.pattern) || ' migration #' || m.id || ' of ' || m.table_schema "
            "|| '.' || m.table_name || ' (' || m.state || ')' FROM outbox_migrate.owned_object o "
            "JOIN outbox_migrate.migration m ON m.id = o.migration_id WHERE o.kind = 'relation' "
            "AND o.object_oid = to_regclass(%s) AND m.state <> 'abandoned' "
            "AND (m.table_schema, m.table_name) <> (%s, %s) ORDER BY m.id LIMIT 1",
            (ident(spec.schema, relation), spec.schema, spec.table),
        ).fetchone()
        if row is not None:
            relations, options = taken.setdefault(str(row[0]), ([], []))
            relations.append(f"{spec.schema}.{relation}")
            options.append(f"{option} NAME")
    findings = []
    for owner, (relations, options) in taken.items():
        one = len(relations) == 1
        findings.append(Finding(
            "name-taken",
            f"{', '.join(relations)} already {'exists' if one else 'exist'}: the {owner} "
            f"created {'it' if one else 'them'}",
            f"give this migration names of its own: {' '.join(options)}",
        ))  # fmt: skip
    return findings


def marker_from_samples(facts: TableFacts, spec: OutboxSpec) -> OutboxSpec:
    """The spec with the marker the sampled evidence names (the playbooks judge sample tables
    through it, so they say what `plan` says)."""
    has_marker = facts.column(spec.published_column) is not None
    detected = marker_catalog.infer_from(spec, has_marker, facts.samples, facts.activity)
    if detected is None:
        return spec
    facts.detected_marker = detected.name
    return replace(spec, published_column=detected.name)


def judge(facts: TableFacts, spec: OutboxSpec, pattern: str = "") -> None:
    """Fill `blockers`, `warnings`, `notes` and `objects` from the facts (pure; unit-testable).
    With a `pattern`, what only that pattern needs is a blocker (HOPER: a unique id index)."""
    table = Names(spec).display(spec.table)
    block = facts.blockers
    if facts.relkind == "p" or facts.is_partition:
        already = "partitioned" if facts.relkind == "p" else "a partition"
        block.append(Finding(
            "already-partitioned",
            f"{table} is already {already}",
            "nothing to migrate, or point --table at the flat outbox",
        ))  # fmt: skip
    elif facts.activity.deletes_on_delivery():
        # Nothing else matters: the table is not partitioned, so nothing else is lost.
        block.append(marker_judge.deletes_on_delivery(facts, table))
        return
    id_judge.judge_id(facts, spec, table)
    for pub in facts.publication_details:
        if pub.columns and pub.publishes_changes and pub.explicit and not pub.covers_new_tables:
            block.append(Finding(
                "cdc-column-list",
                f"publication {pub.name} publishes only columns {', '.join(pub.columns)} of "
                f"{table} and also its UPDATEs/DELETEs",
                "the partition it must reach needs REPLICA IDENTITY FULL (the relay's mark is a "
                "cross-partition UPDATE), which a column list cannot cover, so every mark "
                "would fail: set the publication to publish = 'insert' or drop its column list",
            ))  # fmt: skip
    if facts.column(spec.published_column) is None:
        block.append(marker_judge.missing_marker(facts, spec, table))
    else:
        spec = marker_judge.judge_marker(facts, spec, table)
    for name, referrer in facts.foreign_keys_in:
        # `referrer` is regclass text: quoted where needed, qualified outside the search_path.
        drop = f"ALTER TABLE {referrer} DROP CONSTRAINT {ident(name)}"
        block.append(Finding(
            "fk-into-outbox",
            f"foreign key {ident(name)} on {referrer} references {table}",
            "drop it or point it elsewhere: uniqueness of ids is not enforced across "
            f"partitions, so no foreign key can reference the partitioned outbox ({drop})",
            drop,
        ))  # fmt: skip
    _warnings(facts, table)
    _judge_objects(facts, spec, table, pattern)
    lost_rules.judge_lost_semantics(facts, spec, table)


def _judge_objects(facts: TableFacts, spec: OutboxSpec, table: str, pattern: str) -> None:
    """What happens to every index, CHECK and trigger of the old table (`facts.objects`), and
    the blockers among them."""
    parent, published = spec.partitioned_table, spec.published_column
    key_rule = (
        f"not carried to {parent}: a unique index on a partitioned table must include the "
        f"partition key ({published}), so it could not guard the same columns there"
    )
    unique_id = False
    lost = {key.name for key in lost_rules.lost_unique_keys(facts, spec)}
    for name, definition, primary, unique, valid in facts.index_details:
        if primary or unique:
            columns = definition[definition.rfind("(") + 1 : definition.rfind(")")]
            quoted = '"' + spec.id_column.replace('"', '""') + '"'
            if columns in (spec.id_column, quoted) and valid and " WHERE " not in definition:
                unique_id = True
            ids = (
                f"nothing enforces it on {parent} (lost-unique)"
                if name in lost
                else "ids stay unique by construction (the new identity starts above the old ids)"
                if spec.id_kind == "database"
                else "the application must keep ids unique across both tables"
            )
            fate = f"stays on {table} (and with it after the swap); {key_rule}; {ids}"
            facts.objects.append(
                ObjectFact("primary key" if primary else "unique index", name, definition, fate)
            )
            continue
        if marker_judge.serves_the_relay(definition, spec):
            fate = (
                f"serves the relay on {table} until it is drained; after a swap {table} holds "
                f"published rows only and the index stays empty: DROP INDEX CONCURRENTLY "
                f"{ident(spec.schema, name)}"
            )
        else:
            fate = (
                f"stays on {table} (after a swap it covers the published rows there); not "
                f"created on {parent}: create it there if queries on new rows need it "
                f"(CREATE INDEX ON {parent} …, then on each partition)"
            )
        facts.objects.append(ObjectFact("index", name, definition, fate))
    for name, definition, validated, noinherit in facts.check_details:
        if noinherit:
            facts.blockers.append(Finding(
                "check-no-inherit",
                f"CHECK {name} on {table} is NO INHERIT",
                "a partitioned table cannot have one; drop it, or re-create it without NO "
                "INHERIT",
            ))  # fmt: skip
        elif not validated:
            fix = f"ALTER TABLE {ident(spec.schema, spec.table)} VALIDATE CONSTRAINT {ident(name)}"
            facts.blockers.append(Finding(
                "check-not-valid",
                f"CHECK {name} on {table} is NOT VALID",
                f"validate it first ({fix}; reads the table under SHARE UPDATE EXCLUSIVE): it "
                f"is copied to {parent}, and the swap attaches the old table, which then must "
                "satisfy it",
                fix,
            ))  # fmt: skip
        facts.objects.append(ObjectFact("check", name, definition, (
            f"copied to {parent} in V2 (LIKE … INCLUDING CONSTRAINTS; the table is empty, so "
            "it is valid at once): the new table refuses at insert what the old one refused, "
            "so no published row can be refused later when it is copied or attached into "
            f"{table}"
        )))  # fmt: skip
    for name, definition, enabled in facts.trigger_details:
        if name == spec.gate_tick:
            facts.objects.append(ObjectFact("trigger", name, definition, (
                "installed by this migration (V2) so the deploy gates see every old writer, "
                "whether it supplies its ids or not; removed after the last gate"
            )))  # fmt: skip
            continue
        facts.objects.append(
            ObjectFact("trigger", name, definition, _trigger_fate(definition, enabled, spec))
        )
    if not unique_id and facts.column(spec.id_column) is not None:
        fix = (f"CREATE UNIQUE INDEX CONCURRENTLY ON {ident(spec.schema, spec.table)} "
               f"({ident(spec.id_column)})")  # fmt: skip
        (facts.blockers if pattern == "hoper" else facts.warnings).append(Finding(
            "no-unique-id",
            f"{table} has no unique index on {spec.id_column}",
            f"HOPER's copy-back needs one and its V2 refuses to start without it: {fix}; the "
            "other patterns do not",
            fix,
        ))  # fmt: skip


def _trigger_fate(definition: str, enabled: str, spec: OutboxSpec) -> str:
    """When a trigger on the old table fires once the migration starts."""
    if enabled == "D":
        return "disabled; stays on the old table and never fires"
    table, parent = spec.table, spec.partitioned_table
    upper = definition.upper()
    timing = upper.split(" ON ", 1)[0]
    fires: list[str] = [f"V1 writes to {table} fire it as before"]
    if " INSERT" in timing:
        fires.append(
            "new messages (V2 on) go to "
            f"{parent} and do not fire it; HOPIA's copy trigger (V2 on) and HOPER's copy-back "
            f"insert every published row into {table} and do fire it; after a swap every "
            f"publish moves a row into {table} (DELETE + INSERT) and fires it"
        )
    if " UPDATE" in timing:
        fires.append(f"the relay's publishing UPDATE fires it while it publishes from {table}")
    if " DELETE" in timing:
        fires.append(f"retention deletes on {table} fire it")
    return (
        "; ".join(fires)
        + f". It is not carried to {parent}: if the application relies on it, re-create it "
        "there under another name (the swap's ATTACH clones the parent's row triggers onto "
        f"{table} and refuses a name {table} already uses), and disable it on the old table "
        "at the swap so it does not fire twice (optional step disable-old-triggers)"
    )


def _warnings(facts: TableFacts, table: str) -> None:
    warn = facts.warnings
    for pub in facts.publication_details:
        how = ("FOR ALL TABLES" if pub.all_tables else "TABLES IN SCHEMA" if pub.by_schema
               else "FOR TABLE")  # fmt: skip
        warn.append(Finding(
            "cdc-publication",
            f"publication {pub.name} ({how}) includes {table}",
            ("it covers the partitions by itself; V2's step publish-unpublished-partition "
             "gives them a replica identity if it publishes UPDATE/DELETE"
             if pub.covers_new_tables else
             "V2's step publish-unpublished-partition adds the unpublished partition to it "
             "before V2 writes there")
            + "; the consumer must follow the new relation name and emit an INSERT only when "
            "the publication column is NULL (a mark, a copy and the swap re-insert rows with "
            "it set) — `plan` shows per phase what the stream carries (docs/patterns.md, "
            "CDC consumers)",
        ))  # fmt: skip
    for column in facts.columns:
        if column.generated:
            warn.append(Finding(
                "generated-column", f"{table}.{column.name} is a generated column",
                "HOPER's copy-back and HOPIA's copy trigger insert whole rows, and PostgreSQL "
                "refuses explicit values for a generated column (under HOPIA the relay's "
                "publishing UPDATE would fail); for those patterns make it a plain column "
                "first, or choose COP, COPRA or HOP",
            ))  # fmt: skip
    if facts.foreign_keys_out:
        warn.append(Finding(
            "fk-out", f"{table} has foreign keys to other tables "
            f"({', '.join(n for n, _ in facts.foreign_keys_out)})",
            "they are not copied to the new table; re-create them there if needed",
        ))  # fmt: skip


def inspect(dsn: str, spec: OutboxSpec, pattern: str = "") -> TableFacts:
    from outbox_migrate.db import connect

    with connect(dsn) as conn:
        return introspect(conn, spec, pattern)


def raise_for_blockers(facts: TableFacts) -> None:
    """Refuse (exit 2) with every blocker and its fix: one blocker is the error line itself;
    several are one line each above a line that counts them."""
    if not facts.blockers:
        return
    if len(facts.blockers) == 1:
        only = facts.blockers[0]
        raise SchemaError(f"{only.message}: {only.remedy}")
    count = len(facts.blockers)
    table = facts.table if facts.schema == "public" else f"{facts.schema}.{facts.table}"
    raise Blocked(
        f"{count} blockers stop the migration of {table}, each listed with its fix",
        [f"blocker {i}/{count}: {b.message}: {b.remedy}" for i, b in enumerate(facts.blockers, 1)],
    )


__all__ = [
    "ASSUMED_SCAN_BYTES_PER_S",
    "ID_TYPES",
    "ColumnFact",
    "ObjectFact",
    "TableFacts",
    "inspect",
    "introspect",
    "judge",
    "publication_facts",
    "raise_for_blockers",
]
