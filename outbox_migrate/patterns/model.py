"""The vocabulary of a migration: patterns → phases → steps → conditions. Inert data only: the
runner, `plan`, Alembic and the golden tests read the same objects, so what the operator
reviews is exactly what runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum

from psycopg import sql

from outbox_migrate.lock_budget import LockMode

Statement = sql.Composed | sql.SQL
"""A statement psycopg can execute as-is: composed SQL, identifiers already quoted."""


class TxMode(StrEnum):
    TRANSACTION = "transaction"
    """All statements and the ledger row commit together, or none do."""
    AUTOCOMMIT = "autocommit"
    """Statements that refuse a transaction block (CONCURRENTLY, VALIDATE kept short-lived)."""
    NONE = "none"
    """No SQL: a deploy gate or a job run by its own module."""


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
    inserts_into: Table
    publishes_from: Table
    renamed: bool = False
    """The partitioned table goes by the flat table's original name (the optional last
    phases): `new` is then called what `old` was."""

    def describe(self, old: str, new: str) -> str:
        if self.renamed:
            new = old
        names = {Table.OLD: old, Table.NEW: new, Table.NONE: "nothing"}
        target = names.get(self.inserts_into, self.inserts_into.value)
        if self.publishes_from is Table.OLD_THEN_NEW:
            source = f"{old} until it is drained and no writer is left, then {new}"
        else:
            source = names[self.publishes_from]
        return f"inserts into {target}; publishes from {source}"


class CheckPoint(StrEnum):
    """When the runner evaluates a precondition. A check made before waiting for a lock proves
    nothing about the moment of commit, so the default is LOCKED; the two exceptions must name
    what keeps them true until commit."""

    LOCKED = "locked"
    """In the step's transaction, after its declared locks are held, on every attempt."""
    SAMPLED = "sampled"
    """Before the transaction: it watches the database over a window (a deploy gate). A LOCKED
    companion re-proves, under the lock, that nothing changed since the window ended."""
    SCAN = "scan"
    """Before the transaction: it reads many rows, too slow to run under ACCESS EXCLUSIVE.
    `kept_by` names the LOCKED condition or lock that keeps its result true until commit."""


@dataclass(frozen=True)
class Condition:
    """A named check on the live database: its query returns one text row per violation (none:
    it holds), online and compiled to a `DO … RAISE EXCEPTION` block for offline SQL."""

    name: str
    description: str
    query: Statement
    at: CheckPoint = CheckPoint.LOCKED
    kept_by: str = ""

    def sql_text(self) -> str:
        return self.query.as_string(None)


@dataclass(frozen=True)
class Lock:
    relation: str
    mode: LockMode


@dataclass(frozen=True)
class PublicationFact:
    """A logical-replication publication that covers the old outbox, as introspected (the
    `publish-unpublished-partition` kind carries it to the partitioned outbox)."""

    name: str
    explicit: bool = True
    """The old table is listed in it (`FOR TABLE`), as opposed to covered by ALL TABLES or
    TABLES IN SCHEMA (which cover new tables by themselves)."""
    all_tables: bool = False
    by_schema: bool = False
    via_root: bool = False
    insert: bool = True
    update: bool = True
    delete: bool = True
    row_filter: str | None = None
    """The old table's row filter (PostgreSQL 15+), as `pg_get_expr` prints it."""
    columns: tuple[str, ...] | None = None
    """The old table's column list (PostgreSQL 15+); None: every column."""

    @property
    def covers_new_tables(self) -> bool:
        return self.all_tables or self.by_schema

    @property
    def publishes_changes(self) -> bool:
        """UPDATE or DELETE are published: every table in it needs a replica identity, or
        the relay's mark (a cross-partition UPDATE) fails."""
        return self.update or self.delete


@dataclass(frozen=True)
class Created:
    """An object a step creates, so the ledger can record it by OID: a migration only ever
    drops (on rollback) or adopts (on re-run) what it can prove is its own."""

    kind: str
    """`relation` (table or index), `constraint`, `trigger` or `function`."""
    name: str
    on: str = ""
    """The relation a constraint or trigger belongs to."""


CATALOG_TIMEOUT_MS = 2_000
"""statement_timeout of catalog-only DDL: generous for catalog work, fatal for a table scan."""
SCAN_GUARD_TIMEOUT_MS = 1_000
"""ATTACH runs under this: if PostgreSQL decided to scan after all, it fails in a second
instead of holding ACCESS EXCLUSIVE for minutes."""
CREATE_TIMEOUT_MS = 10_000


@dataclass(frozen=True, kw_only=True)
class Step:
    """One database change between two deploys, described completely and inertly."""

    id: str
    kind: str
    phase: str
    summary: str
    app_before: str
    app_after: str
    statements: tuple[Statement, ...]
    tx: TxMode = TxMode.TRANSACTION
    locks: tuple[Lock, ...]
    scan: str = ""
    """Empty when the step reads no table rows; else what it scans and what lets it skip."""
    preconditions: tuple[Condition, ...]
    postcondition: tuple[Condition, ...]
    """All hold ⇔ the step's effect is in place (re-runs and crash recovery rely on it).
    Empty only for steps whose proof is their ledger row (deploy gates)."""
    reverse: tuple[Statement, ...] | None
    reverse_note: str
    reverse_preconditions: tuple[Condition, ...] = ()
    statement_timeout_ms: int | None = CATALOG_TIMEOUT_MS
    """None: unlimited (VALIDATE scans); else short, so a mistaken scan fails fast."""
    optional: bool = False
    catalog_only: bool = False
    """True when the ACCESS EXCLUSIVE part touches only the catalog (bounded, size-independent)."""
    notes: tuple[str, ...] = ()
    undone_by: tuple[str, ...] = ()
    """Kinds of later steps that deliberately undo this step's effect (its postcondition then
    stops being an invariant of the migration)."""
    creates: tuple[Created, ...] = ()
    """Objects this step creates (recorded by OID in the ledger when it commits)."""
    reverse_creates: tuple[Created, ...] = ()
    """Objects this step's inverse re-creates (DROP CHECK's inverse adds the CHECK back): they
    are recorded too, so rolling back further may drop them again."""
    executor: str = "sql"
    """Who carries the step out: `sql` (its statements, by the runner) or a job's name
    (`copy-back`); the runner looks the executor up instead of branching on kinds."""
    restates_end_state: bool = False
    """Its postcondition states the migration's whole end state under new names (the rename to
    the original name): earlier steps' postconditions name relations that no longer carry
    those names, so they stop being invariants once this step is reached."""
    formerly: tuple[tuple[Statement, ...], ...] = ()
    """Earlier releases' statements for this step whose effect the current postcondition still
    describes: a migration started with such a release and past this step is adopted (its
    ledger row takes the current checksum) instead of refused."""

    def conditions_at(self, point: CheckPoint) -> tuple[Condition, ...]:
        return tuple(c for c in self.preconditions if c.at is point)

    @property
    def reversible(self) -> bool:
        return self.reverse is not None

    @property
    def strongest_lock(self) -> LockMode | None:
        order = list(LockMode)
        return max((lock.mode for lock in self.locks), key=order.index, default=None)

    def sql_texts(self) -> list[str]:
        return [statement.as_string(None) for statement in self.statements]

    def checksum(self, statements: tuple[Statement, ...] | None = None) -> str:
        """Fingerprint of what the step does (with `statements`: of an earlier release's
        definition); a step changed after it ran is refused."""
        chosen = self.statements if statements is None else statements
        digest = hashlib.sha256()
        for part in (self.id, self.tx.value, *(s.as_string(None) for s in chosen)):
            digest.update(part.encode())
            digest.update(b"\x00")
        # Preconditions are left out on purpose: they say when a step may run (and embed
        # tunables such as the gate's sampling window), not what it does.
        for condition in self.postcondition:
            digest.update(condition.sql_text().encode())
            digest.update(b"\x00")
        return digest.hexdigest()[:16]

    @property
    def former_checksums(self) -> tuple[str, ...]:
        """The checksums of `formerly`, the definitions a ledger row may have recorded."""
        return tuple(self.checksum(statements) for statements in self.formerly)


@dataclass(frozen=True)
class Phase:
    name: str
    kind: PhaseKind
    title: str
    app: AppBehaviour
    instructions: tuple[str, ...]
    steps: tuple[Step, ...]
    optional: bool = False
    """Only with --with-optional (the original-name phases): the migration is complete
    without it."""
    unread: tuple[Condition, ...] = ()
    """What `verify` checks besides the steps' postconditions while this phase's version
    runs: no unpublished row waits in a table no relay reads then (`no_unread_rows`)."""


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

    def last_required_phase(self) -> str:
        """Reaching it completes the migration; optional phases may still follow."""
        return [phase for phase in self.phases if not phase.optional][-1].name

    def verified(self, phase: str, done: frozenset[str]) -> list[Condition]:
        """What `verify` checks at `phase`: the invariants (with the ledger's `done`), then
        that no row waits unread (`Phase.unread`)."""
        held = [condition for _, condition in self.invariants(phase, done)]
        return held + list(self.phase(phase).unread)

    def steps_through(self, phase: str) -> list[Step]:
        last = self.phases.index(self.phase(phase))
        return [step for earlier in self.phases[: last + 1] for step in earlier.steps]

    def invariants(
        self, phase: str, done: frozenset[str] | None = None
    ) -> list[tuple[Step, Condition]]:
        """What must hold once every step through `phase` is done: each step's postcondition,
        unless a later step deliberately undid it — a later step of `phase` or before, or one
        of the next phase already `done` (ids from the ledger: between two steps of a phase,
        the swap has undone the published partition's attachment on purpose).

        `done` None: as the plan leaves it (every step done); given (from the ledger), an
        optional step not in it is left out — the migration ran without it (`run` without
        --with-optional, or a later one that passed it by: runner/decide.py `skipped`)."""
        through = self.steps_through(phase)
        steps_done = done or frozenset()
        steps = through if done is None else [s for s in through if s.id in done or not s.optional]
        ahead_steps = [s for s in self.steps()[len(through) :] if s.id in steps_done]
        ahead = {s.kind for s in ahead_steps}
        # A step that restates the end state under new names supersedes every earlier one.
        restating_ahead = [s for s in ahead_steps if s.restates_end_state]
        if restating_ahead:
            return [(restating_ahead[-1], c) for c in restating_ahead[-1].postcondition]
        restating = [i for i, s in enumerate(steps) if s.restates_end_state]
        steps = steps[restating[-1] if restating else 0 :]
        held: list[tuple[Step, Condition]] = []
        for index, step in enumerate(steps):
            later = {other.kind for other in steps[index + 1 :]} | ahead
            if later.intersection(step.undone_by):
                continue
            held.extend((step, condition) for condition in step.postcondition)
        return held
