"""The live outbox as facts: its columns, ids, size, indexes, constraints, triggers and what
plan found about them. Pure data, below both the reading (introspect.py) and every judge of
it (id_judge, marker_judge, lost_semantics), so none of them imports another for the types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outbox_migrate.advisory import Finding
from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns.marker_catalog import Activity, ColumnSample
from outbox_migrate.patterns.model import PublicationFact

ID_TYPES = frozenset({"bigint", "integer"})
"""Types of database-generated ids (identity, serial, nextval default)."""
ASSUMED_SCAN_BYTES_PER_S = 200 * 1024 * 1024
"""Sequential-read rate used only to *estimate* VALIDATE/copy durations in plans."""


@dataclass(frozen=True)
class UniqueKey:
    """A valid unique index of the old table (a primary key or UNIQUE constraint included)."""

    name: str
    kind: str
    """`primary key`, `unique constraint` or `unique index`."""
    columns: tuple[str | None, ...]
    """Key columns in order; None for an expression."""
    partial: bool
    definition: str

    def shown(self) -> str:
        return ", ".join(c if c is not None else "(expression)" for c in self.columns)


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
class ObjectFact:
    """An object on the old table (primary key, index, CHECK, trigger) and what the migration
    does with it, so `plan` can say it for every one."""

    kind: str
    name: str
    definition: str
    fate: str


@dataclass(kw_only=True)
class TableFacts:
    """Everything the plan, the wizard and the runner need to know about the live outbox."""

    schema: str
    table: str
    server_version: int
    server_version_text: str
    relkind: str
    is_partition: bool
    columns: list[ColumnFact]
    max_id: int | None = None
    sequence: str | None = None
    sequence_last_value: int | None = None
    row_estimate: int
    unpublished: int = 0
    total_bytes: int
    heap_bytes: int
    inserts: int
    indexes: list[tuple[str, str]] = field(default_factory=list)
    constraints: list[tuple[str, str, bool]] = field(default_factory=list)
    triggers: list[tuple[str, str]] = field(default_factory=list)
    foreign_keys_in: list[tuple[str, str]]
    foreign_keys_out: list[tuple[str, str]]
    publications: list[str]
    publication_details: list[PublicationFact] = field(default_factory=list)
    """Each publication covering the table, with what the catalog must carry (CDC users)."""
    new_table_state: dict[str, str] = field(default_factory=dict)
    random_uuid_ids: bool = False
    """The newest rows' uuid ids are version 4 (random): they do not sort by time."""
    sequence_owned: bool = False
    """The id's sequence is owned by the column (serial/bigserial), not just named by its
    `nextval` default."""
    index_details: list[tuple[str, str, bool, bool, bool]] = field(default_factory=list)
    """(name, definition, primary, unique, valid) of each index."""
    check_details: list[tuple[str, str, bool, bool]] = field(default_factory=list)
    """(name, definition, validated, no inherit) of each CHECK constraint."""
    trigger_details: list[tuple[str, str, str]] = field(default_factory=list)
    """(name, definition, enabled: O/D/R/A) of each user trigger."""
    unique_keys: list[UniqueKey] = field(default_factory=list)
    updates: int = 0
    deletes: int = 0
    """With `inserts`: the table's own counters, which say whether it deletes what it
    delivers."""
    samples: list[ColumnSample] = field(default_factory=list)
    """Each column that could be the marker, with what a bounded read of its rows found."""
    detected_marker: str = ""
    """The marker column taken from the evidence (the setting was left at its default)."""
    blockers: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    notes: list[Finding] = field(default_factory=list)
    """How the plan handles what is unusual about this table (id kind, …); nothing to do."""
    objects: list[ObjectFact] = field(default_factory=list)

    @property
    def activity(self) -> Activity:
        return Activity(self.inserts, self.updates, self.deletes)

    def sample(self, name: str) -> ColumnSample | None:
        return next((s for s in self.samples if s.name == name), None)

    def primary_key(self) -> tuple[str, ...]:
        """The primary key's columns (none when it has none, or an expression)."""
        key = next((k for k in self.unique_keys if k.kind == "primary key"), None)
        if key is None or None in key.columns:
            return ()
        return tuple(c for c in key.columns if c is not None)

    def column(self, name: str) -> ColumnFact | None:
        return next((c for c in self.columns if c.name == name), None)

    @property
    def id_top(self) -> int:
        """The highest id the old table holds or its sequence has handed out."""
        return max(self.max_id or 0, self.sequence_last_value or 0)

    def identity_generation(self, spec: OutboxSpec) -> str:
        """`BY DEFAULT` or `ALWAYS`: how the old id is generated, so what the new table's
        identity accepts (only `GENERATED ALWAYS` refuses a supplied id) and what reversing
        DROP IDENTITY restores."""
        column = self.column(spec.id_column)
        return "ALWAYS" if column is not None and column.identity == "a" else "BY DEFAULT"

    def identity_start(self, headroom: int) -> int:
        return self.id_top + headroom

    def id_kind(self, spec: OutboxSpec) -> str:
        """`identity`, `sequence`, `none` (an integer with no generator), `application`
        (a non-integer id, e.g. uuid, or an integer with no generator that the settings say
        the application makes: snowflake ids) or `missing`."""
        column = self.column(spec.id_column)
        if column is None:
            return "missing"
        if column.type not in ID_TYPES and column.type != "smallint":
            return "application"
        if column.identity:
            return "identity"
        if self.sequence:
            return "sequence"
        return "application" if spec.id_kind == "application" else "none"

    def estimated_scan_s(self) -> float:
        return self.heap_bytes / ASSUMED_SCAN_BYTES_PER_S
