"""The vocabulary of a migration: patterns → phases → steps → conditions. Inert data only.

A `Step` describes; it never holds a connection. The runner, `plan`, Alembic (online and
offline) and the golden tests all read the same objects, so what the operator reviews is
exactly what runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum

from psycopg import sql

Statement = sql.Composed | sql.SQL
"""A statement psycopg can execute as-is: composed SQL, identifiers already quoted."""


class TxMode(StrEnum):
    """How a step's statements are executed."""

    TRANSACTION = "transaction"
    """All statements and the ledger row commit together, or none do."""
    AUTOCOMMIT = "autocommit"
    """Statements that refuse a transaction block (CONCURRENTLY, VALIDATE kept short-lived)."""
    NONE = "none"
    """No SQL: a deploy gate or a job run by its own module."""


class LockMode(StrEnum):
    """PostgreSQL table lock modes, weakest first (the names `pg_locks.mode` uses)."""

    ACCESS_SHARE = "AccessShareLock"
    ROW_SHARE = "RowShareLock"
    ROW_EXCLUSIVE = "RowExclusiveLock"
    SHARE_UPDATE_EXCLUSIVE = "ShareUpdateExclusiveLock"
    SHARE = "ShareLock"
    SHARE_ROW_EXCLUSIVE = "ShareRowExclusiveLock"
    EXCLUSIVE = "ExclusiveLock"
    ACCESS_EXCLUSIVE = "AccessExclusiveLock"

    @property
    def blocks_writers(self) -> bool:
        """True when INSERT/UPDATE (RowExclusiveLock) must wait for this lock."""
        return self in {
            LockMode.SHARE,
            LockMode.SHARE_ROW_EXCLUSIVE,
            LockMode.EXCLUSIVE,
            LockMode.ACCESS_EXCLUSIVE,
        }

    @property
    def sql_name(self) -> str:
        """The mode as written in LOCK TABLE (`ACCESS EXCLUSIVE`)."""
        words: list[str] = []
        for char in self.value.removesuffix("Lock"):
            if char.isupper() and words:
                words.append(" ")
            words.append(char.upper())
        return "".join(words)


class PhaseKind(StrEnum):
    DEPLOY = "deploy"
    """An application version rolled out (V1..V4); the runner stops before crossing one."""
    JOB = "job"
    """Work after the last deploy that the tool runs itself (HOPER's copy-back)."""


class Table(StrEnum):
    """Which outbox an application version uses."""

    OLD = "old"
    NEW = "new"
    OLD_THEN_NEW = "old-then-new"
    NONE = "none"


@dataclass(frozen=True)
class AppBehaviour:
    """What an application version does: where it inserts and where it publishes from."""

    inserts_into: Table
    publishes_from: Table

    def describe(self, old: str, new: str) -> str:
        names = {Table.OLD: old, Table.NEW: new, Table.NONE: "nothing"}
        target = names.get(self.inserts_into, self.inserts_into.value)
        if self.publishes_from is Table.OLD_THEN_NEW:
            source = f"{old} until it is drained and no writer is left, then {new}"
        else:
            source = names[self.publishes_from]
        return f"inserts into {target}; publishes from {source}"


@dataclass(frozen=True)
class Condition:
    """A named check on the live database: its query returns one text row per violation.

    No rows means the condition holds. The same query runs in the runner, in Alembic online
    mode, and compiles to a `DO … RAISE EXCEPTION` block for offline SQL.
    """

    name: str
    description: str
    query: Statement

    def sql_text(self) -> str:
        return self.query.as_string(None)


@dataclass(frozen=True)
class Lock:
    """A lock a step takes on one relation, and why it is acceptable."""

    relation: str
    mode: LockMode


@dataclass(frozen=True)
class Step:
    """One database change between two deploys, described completely and inertly."""

    id: str
    kind: str
    phase: str
    summary: str
    app_before: str
    app_after: str
    statements: tuple[Statement, ...]
    tx: TxMode
    locks: tuple[Lock, ...]
    scan: str
    """Empty when the step reads no table rows; else what it scans and what lets it skip."""
    preconditions: tuple[Condition, ...]
    postcondition: tuple[Condition, ...]
    """All hold ⇔ the step's effect is in place (re-runs and crash recovery rely on it).
    Empty only for steps whose proof is their ledger row (deploy gates)."""
    reverse: tuple[Statement, ...] | None
    reverse_note: str
    reverse_preconditions: tuple[Condition, ...]
    statement_timeout_ms: int | None
    """None: unlimited (VALIDATE scans); else short, so a mistaken scan fails fast."""
    optional: bool = False
    catalog_only: bool = False
    """True when the ACCESS EXCLUSIVE part touches only the catalog (bounded, size-independent)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    undone_by: tuple[str, ...] = field(default_factory=tuple)
    """Kinds of later steps that deliberately undo this step's effect (its postcondition then
    stops being an invariant of the migration)."""

    @property
    def reversible(self) -> bool:
        return self.reverse is not None

    @property
    def strongest_lock(self) -> LockMode | None:
        order = list(LockMode)
        return max((lock.mode for lock in self.locks), key=order.index, default=None)

    def sql_texts(self) -> list[str]:
        return [statement.as_string(None) for statement in self.statements]

    def checksum(self) -> str:
        """Fingerprint of what the step does; a step changed after it ran is refused."""
        digest = hashlib.sha256()
        for part in (self.id, self.tx.value, *self.sql_texts()):
            digest.update(part.encode())
            digest.update(b"\x00")
        # Preconditions are left out on purpose: they say when a step may run (and embed
        # tunables such as the gate's sampling window), not what it does.
        for condition in self.postcondition:
            digest.update(condition.sql_text().encode())
            digest.update(b"\x00")
        return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Phase:
    name: str
    kind: PhaseKind
    title: str
    app: AppBehaviour
    instructions: tuple[str, ...]
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Pattern:
    name: str
    acronym: str
    title: str
    summary: str
    pause_publication: bool
    keep_old_rows: bool
    immediate_access: bool
    phases: tuple[Phase, ...]
    point_of_no_return: str
    """Id of the first step whose reverse is not offered (empty: every step reverses)."""

    def steps(self) -> list[Step]:
        return [step for phase in self.phases for step in phase.steps]

    def phase(self, name: str) -> Phase:
        for phase in self.phases:
            if phase.name.lower() == name.lower():
                return phase
        raise KeyError(name)

    def phase_names(self) -> list[str]:
        return [phase.name for phase in self.phases]

    def steps_through(self, phase: str) -> list[Step]:
        """Every step up to and including `phase`."""
        steps: list[Step] = []
        for candidate in self.phases:
            steps.extend(candidate.steps)
            if candidate.name.lower() == phase.lower():
                return steps
        raise KeyError(phase)

    def invariants(self, phase: str) -> list[tuple[Step, Condition]]:
        """What must hold once every step through `phase` is done: each step's postcondition,
        unless a later step (through `phase`) deliberately undid it."""
        steps = self.steps_through(phase)
        held: list[tuple[Step, Condition]] = []
        for index, step in enumerate(steps):
            later = {other.kind for other in steps[index + 1 :]}
            if later.intersection(step.undone_by):
                continue
            held.extend((step, condition) for condition in step.postcondition)
        return held
