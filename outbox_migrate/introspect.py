"""Read the live outbox into `TableFacts`, and judge what stands in the migration's way.

Read-only: catalog queries plus `max(id)` and an exact unpublished count (cheap thanks to the
relay's partial index). Blockers are facts that make the patterns unsafe or impossible, each
with what to do; warnings are facts the operator must know but that do not stop the plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from psycopg import Connection, sql

from outbox_migrate import sql as queries
from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import SchemaError
from outbox_migrate.patterns.names import Names

ID_TYPES = frozenset({"bigint"})
PUBLISHED_TYPES = frozenset({"timestamp with time zone", "timestamp without time zone"})
ASSUMED_SCAN_BYTES_PER_S = 200 * 1024 * 1024
"""Sequential-read rate used only to *estimate* VALIDATE/copy durations in plans."""


@dataclass(frozen=True)
class ColumnFact:
    name: str
    type: str
    default: str | None
    not_null: bool
    collation: str | None
    identity: str
    """'a' GENERATED ALWAYS, 'd' BY DEFAULT, '' none."""
    generated: str


@dataclass(frozen=True)
class Finding:
    """A blocker or warning: what was found and what to do."""

    code: str
    message: str
    remedy: str


@dataclass
class TableFacts:
    """Everything the plan, the wizard and the runner need to know about the live outbox."""

    schema: str
    table: str
    server_version: int
    server_version_text: str
    relkind: str
    is_partition: bool
    columns: list[ColumnFact]
    max_id: int | None
    sequence: str | None
    sequence_last_value: int | None
    row_estimate: int
    unpublished: int
    total_bytes: int
    heap_bytes: int
    inserts: int
    indexes: list[tuple[str, str]]
    constraints: list[tuple[str, str, bool]]
    triggers: list[tuple[str, str]]
    foreign_keys_in: list[tuple[str, str]]
    foreign_keys_out: list[tuple[str, str]]
    publications: list[str]
    new_table_state: dict[str, str] = field(default_factory=dict)
    blockers: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)

    def column(self, name: str) -> ColumnFact | None:
        return next((c for c in self.columns if c.name == name), None)

    @property
    def id_top(self) -> int:
        """The highest id the old table holds or its sequence has handed out."""
        return max(self.max_id or 0, self.sequence_last_value or 0)

    def identity_generation(self, spec: OutboxSpec) -> str:
        """`BY DEFAULT` or `ALWAYS`: how the old id is generated, for reversing DROP IDENTITY."""
        column = self.column(spec.id_column)
        return "BY DEFAULT" if column is not None and column.identity == "d" else "ALWAYS"

    def identity_start(self, headroom: int) -> int:
        return self.id_top + headroom

    def estimated_scan_s(self) -> float:
        return self.heap_bytes / ASSUMED_SCAN_BYTES_PER_S

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _rows(conn: Connection[Any], name: str, **parts: sql.Composable) -> list[tuple[Any, ...]]:
    return list(conn.execute(queries.query("introspect", name).compose(**parts)).fetchall())


def introspect(conn: Connection[Any], spec: OutboxSpec) -> TableFacts:
    """Read the facts; raise `SchemaError` when the table does not exist at all."""
    n = Names(spec)
    rel = {"rel_reg": n.reg(spec.table)}
    table_rows = _rows(conn, "table", **rel)
    if not table_rows:
        raise SchemaError(
            f"table {n.display(spec.table)} does not exist in database "
            f"{conn.info.dbname!r}; check --schema/--table (outbox-migrate config)"
        )
    relkind, is_partition, total, heap, estimate, inserts, _upd, _del = table_rows[0]
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
        max_id=None,
        sequence=None,
        sequence_last_value=None,
        row_estimate=int(estimate),
        unpublished=0,
        total_bytes=int(total),
        heap_bytes=int(heap),
        inserts=int(inserts),
        indexes=[(r[0], r[1]) for r in _rows(conn, "indexes", **rel)],
        constraints=[(r[0], r[2], bool(r[3])) for r in _rows(conn, "constraints", **rel)],
        triggers=[(r[0], r[1]) for r in _rows(conn, "triggers", **rel)],
        foreign_keys_in=[(r[0], r[1]) for r in _rows(conn, "foreign-keys-in", **rel)],
        foreign_keys_out=[(r[0], r[1]) for r in _rows(conn, "foreign-keys-out", **rel)],
        publications=[r[0] for r in _rows(conn, "publications", **rel)],
    )
    id_col = facts.column(spec.id_column)
    pub_col = facts.column(spec.published_column)
    if id_col is not None and id_col.type in ID_TYPES:
        ids = _rows(
            conn,
            "ids",
            rel_reg=n.reg(spec.table),
            rel_q=n.q(spec.table),
            id_q=n.id_q,
            id_name=sql.Literal(spec.id_column),
        )[0]
        facts.max_id, facts.sequence, facts.sequence_last_value = ids
    if pub_col is not None:
        facts.unpublished = int(
            _rows(conn, "unpublished", rel_q=n.q(spec.table), published_q=n.published_at_q)[0][0]
        )
    for relation in (spec.partitioned_table, spec.unpublished_partition, spec.published_partition):
        found = _rows(conn, "relation-kind", rel_reg=n.reg(relation))
        if found:
            kind, parent, bound = found[0]
            facts.new_table_state[relation] = (
                f"partition of {parent} {bound}"
                if parent
                else {"p": "partitioned table"}.get(kind, "table")
            )
    judge(facts, spec)
    return facts


def judge(facts: TableFacts, spec: OutboxSpec) -> None:
    """Fill `blockers` and `warnings` from the facts (pure; unit-testable)."""
    table = spec.table if spec.schema == "public" else f"{spec.schema}.{spec.table}"
    block = facts.blockers
    if facts.relkind == "p" or facts.is_partition:
        already = "partitioned" if facts.relkind == "p" else "a partition"
        block.append(Finding(
            "already-partitioned",
            f"{table} is already {already}",
            "nothing to migrate, or point --table at the flat outbox",
        ))  # fmt: skip
    id_col = facts.column(spec.id_column)
    if id_col is None:
        block.append(Finding("id-missing", f"{table} has no column {spec.id_column!r}",
                             "set id_column to the outbox's id column"))  # fmt: skip
    elif id_col.type not in ID_TYPES:
        block.append(Finding(
            "id-type",
            f"{table}.{spec.id_column} is {id_col.type}, not bigint",
            f"ALTER the column to bigint first; the new identity starts "
            f"{spec.id_headroom:,} above the current maximum and must not overflow",
        ))  # fmt: skip
    elif not id_col.identity:
        block.append(Finding(
            "id-not-identity",
            f"{table}.{spec.id_column} is not an identity column"
            + (f" (default {id_col.default})" if id_col.default else ""),
            "convert it to GENERATED BY DEFAULT AS IDENTITY first (the patterns rely on the "
            "identity's own sequence to tell old writers from new ones)",
        ))  # fmt: skip
    pub_col = facts.column(spec.published_column)
    if pub_col is None:
        block.append(Finding(
            "published-missing", f"{table} has no column {spec.published_column!r}",
            "set published_column to the publication timestamp column",
        ))  # fmt: skip
    elif pub_col.type not in PUBLISHED_TYPES:
        block.append(Finding(
            "published-type",
            f"{table}.{spec.published_column} is {pub_col.type}, not a timestamp",
            "the partition key must be the nullable publication timestamp",
        ))  # fmt: skip
    elif pub_col.not_null:
        block.append(Finding(
            "published-not-null", f"{table}.{spec.published_column} is NOT NULL",
            "unpublished rows need NULL there; this is not an outbox the patterns apply to",
        ))  # fmt: skip
    for name, referrer in facts.foreign_keys_in:
        block.append(Finding(
            "fk-into-outbox",
            f"foreign key {name} on {referrer} references {table}",
            "drop it or point it elsewhere: uniqueness of ids is not enforced across "
            "partitions, so no foreign key can reference the partitioned outbox",
        ))  # fmt: skip
    _warnings(facts, table)
    if id_col is not None and id_col.type in ID_TYPES and facts.id_top + spec.id_headroom > 2**62:
        block.append(Finding("id-overflow", "identity START would approach the bigint limit",
                             "lower id_headroom"))  # fmt: skip


def _warnings(facts: TableFacts, table: str) -> None:
    """Facts the operator must know that do not stop the plan."""
    warn = facts.warnings
    for name in facts.publications:
        warn.append(Finding(
            "cdc-publication",
            f"publication {name} includes {table}",
            "logical replication / CDC sees each publish (a row moving between partitions) as "
            "DELETE + INSERT; add the new table with publish_via_partition_root and make "
            "consumers ignore those deletes, or leave the outbox out of the publication",
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
    for name, _definition in facts.triggers:
        warn.append(Finding(
            "trigger", f"trigger {name} on {table} is not carried to the new table",
            "re-create it on the partitioned table if the application relies on it",
        ))  # fmt: skip
    if facts.foreign_keys_out:
        warn.append(Finding(
            "fk-out", f"{table} has foreign keys to other tables "
            f"({', '.join(n for n, _ in facts.foreign_keys_out)})",
            "they are not copied to the new table; re-create them there if needed",
        ))  # fmt: skip


def inspect(dsn: str, spec: OutboxSpec) -> TableFacts:
    """Connect, introspect, disconnect."""
    from outbox_migrate.db import connect

    with connect(dsn) as conn:
        return introspect(conn, spec)


def raise_for_blockers(facts: TableFacts) -> None:
    """One line naming the first blocker (and how many more), for exit code 2."""
    if facts.blockers:
        first = facts.blockers[0]
        more = f" (+{len(facts.blockers) - 1} more blockers)" if len(facts.blockers) > 1 else ""
        raise SchemaError(f"{first.message}: {first.remedy}{more}")
