"""Operator runbooks (`playbooks/<pattern>.md`) generated from the same `Step` objects the
runner executes, so they cannot drift from the catalog. Pure rendering: no database, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from outbox_migrate.advisory.introspect import judge, marker_from_samples
from outbox_migrate.advisory.table_facts import ColumnFact, TableFacts, UniqueKey
from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import BuildOptions, build_pattern
from outbox_migrate.patterns.marker_catalog import ColumnSample
from outbox_migrate.patterns.model import Pattern, Phase, PhaseKind, Step, Table, TxMode
from outbox_migrate.plan import render_markdown

REGENERATE = "python -m tests.golden.regenerate"
ROW_COPYING_KINDS = frozenset({"install-copy-trigger", "copy-back"})
"""Steps that insert whole rows into the old table (explicit values for every column)."""


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _wizard_flags(pattern: Pattern) -> str:
    flags = [
        "--pause" if pattern.pause_publication else "--no-pause",
        "--keep-old-rows" if pattern.keep_old_rows else "--no-keep-old-rows",
    ]
    if not pattern.pause_publication and pattern.keep_old_rows:
        flags.append("--immediate-access" if pattern.immediate_access else "--no-immediate-access")
    return " ".join(flags)


def _locks(step: Step) -> str:
    if not step.locks:
        return "no locks"
    held = ", ".join(f"{lock.mode.sql_name} on `{lock.relation}`" for lock in step.locks)
    if step.catalog_only:
        held += " (catalog-only: brief, independent of table size)"
    return held


def _step_lines(number: int, step: Step) -> list[str]:
    optional = " *(optional)*" if step.optional else ""
    lines = [f"{number}. `{step.id}`{optional}: {step.summary}.", f"   - Locks: {_locks(step)}."]
    if step.scan:
        lines.append(f"   - Scan: {step.scan}.")
    if step.preconditions:
        checks = ", ".join(f"`{c.name}`" for c in step.preconditions)
        lines.append(f"   - Checked first: {checks}.")
    if step.postcondition:
        done = ", ".join(f"`{c.name}`" for c in step.postcondition)
        lines.append(f"   - Done when: {done}.")
    if step.reverse is None:
        lines.append(f"   - Back out: **no** ({step.reverse_note}).")
    elif step.reverse:
        lines += [f"   - Back out: {step.reverse_note}:", "", "     ```sql"]
        lines += [f"     {s.as_string(None).rstrip(';')};" for s in step.reverse]
        lines.append("     ```")
    else:
        lines.append(f"   - Back out: {step.reverse_note}.")
    lines.extend(f"   - Note: {note}" for note in step.notes)
    return lines


def _application_rollback(previous: Phase | None, phase: Phase, spec: OutboxSpec) -> str:
    if previous is None:
        return ""
    stranded = phase.app.inserts_into is Table.NEW and previous.app.publishes_from not in (
        Table.NEW,
        Table.OLD_THEN_NEW,
    )
    text = f"the application can go back to {previous.name} ("
    text += f"{previous.app.describe(spec.table, spec.partitioned_table)})"
    if stranded:
        text += (
            f", but messages {phase.name} inserted into `{spec.partitioned_table}` are not "
            f"published until a version that publishes from it runs again"
        )
    return text + "."


def _phase_section(
    pattern: Pattern, index: int, phase: Phase, spec: OutboxSpec, lines: list[str]
) -> None:
    previous = pattern.phases[index - 1] if index else None
    job = phase.kind is PhaseKind.JOB
    app = phase.app.describe(spec.table, spec.partitioned_table)
    lines += [
        f"### {index + 1}. {phase.name} ({'job' if job else 'deploy'}): {phase.title}", "",
        f"Application once this phase is done: {app}.", "",
        *(f"- {text}" for text in phase.instructions), "",
    ]  # fmt: skip
    if not phase.steps:
        if previous is None:
            lines += ["This is where you are today; nothing to run.", ""]
        else:
            lines += [
                f"No database steps: roll out {phase.name} once the previous phase is done.",
                "",
            ]
    else:
        when = (
            "Run as a job after the last deploy" if job else f"Run before rolling out {phase.name}"
        )
        optional = " --with-optional" if any(s.optional for s in phase.steps) else ""
        verb = f"run --to {phase.name}{optional}"
        lines += [
            f"{when}: `outbox-migrate {verb} --pattern {pattern.name} --dsn <DSN>`. The runner "
            "records each step in its ledger, takes each lock with a short `lock_timeout` and "
            "retries, checks every precondition again where the step commits, and stops at the "
            f"end of {phase.name}; `outbox-migrate status` shows where the migration is, and the "
            "same command run again resumes.",
            "",
            "For teams that must review the SQL first: `outbox-migrate plan --pattern "
            f"{pattern.name} --dsn <DSN> --format sql`, section `-- phase: {phase.name}`, applied "
            "with `psql -v ON_ERROR_STOP=1 -f` (docs/plan.md); its steps check the same "
            "preconditions, but nothing records them in the ledger for `status` and `run`.",
            "",
        ]
        for number, step in enumerate(phase.steps, start=1):
            lines.extend(_step_lines(number, step))
        lines.append("")
    held = pattern.invariants(phase.name)
    if held and phase.steps:
        lines += [f"Check after {phase.name}: every one of these holds.", ""]
        seen: set[str] = set()
        for step, condition in held:
            if condition.name in seen:
                continue
            seen.add(condition.name)
            source = f"{step.id}, if you ran this optional step" if step.optional else step.id
            lines.append(f"- `{condition.name}` ({source}): {condition.description}")
        lines.append("")
    rollback = _application_rollback(previous, phase, spec)
    reversible = [s for s in phase.steps if s.reverse]
    if rollback or reversible:
        lines += [f"Backing out of {phase.name}:", ""]
        if reversible:
            order = ", ".join(f"`{s.id}`" for s in reversed(reversible))
            lines.append(f"- Database: reverse the steps in reverse order ({order}).")
        if rollback:
            lines.append(f"- Application: {rollback}")
        lines.append("")


TIMESTAMP = "timestamp with time zone"
SERIAL = "nextval('outbox_id_seq'::regclass)"
PRIMARY_KEY = UniqueKey("outbox_pkey", "primary key", ("id",), False, "")
REFERENCING = ("audit_outbox_fk", "FOREIGN KEY (outbox_id) REFERENCES outbox(id)")


def _column(name: str, kind: str, default: str | None = None, identity: str = "") -> ColumnFact:
    return ColumnFact(name, kind, default, name != "published_at", None, identity, "")


def _shape(
    id_kind: str,
    id_default: str | None,
    marker: ColumnFact,
    *,
    keys: tuple[UniqueKey, ...] = (PRIMARY_KEY,),
    foreign_keys_in: tuple[tuple[str, str], ...] = (),
    deletes: int = 0,
) -> tuple[TableFacts, OutboxSpec]:
    """A sample outbox as `plan --dsn` would read it: a bigint or uuid id, the given marker,
    a payload, the rows sampled (the marker NULL, or its constant default, on each); with
    `deletes`, counters showing as many rows deleted as inserted and none updated."""
    columns = [
        _column("id", "uuid" if id_kind == "uuid" else "bigint", id_default,
                "a" if id_kind == "identity" else ""),
        marker, _column("payload", "jsonb"),
    ]  # fmt: skip
    table = TableFacts(
        schema="public", table="outbox", server_version=18, server_version_text="18",
        relkind="r", is_partition=False, columns=columns, max_id=None,
        sequence="public.outbox_id_seq" if id_default or id_kind == "identity" else None,
        sequence_last_value=None, row_estimate=10, unpublished=10, total_bytes=8192,
        heap_bytes=8192, inserts=max(deletes, 10), indexes=[], constraints=[], triggers=[],
        foreign_keys_in=list(foreign_keys_in), foreign_keys_out=[], publications=[],
        unique_keys=list(keys),
        index_details=[(k.name, f"CREATE UNIQUE INDEX {k.name} ON outbox ({k.shown()})",
                        k.kind == "primary key", True, True) for k in keys],
        deletes=deletes,
    )  # fmt: skip
    table.samples = [
        ColumnSample(c.name, c.type, c.default, c.not_null, 10,
                     10 if c.default is None else 0, () if c.default is None else (c.default,), 1)
        for c in columns
    ]  # fmt: skip
    spec = OutboxSpec(id_kind="application") if id_kind == "application" else OutboxSpec()
    return table, marker_from_samples(table, spec)


MARKER = _column("published_at", TIMESTAMP)
Judged = tuple[TableFacts, OutboxSpec]
SHAPES: list[tuple[str, Callable[[], Judged]]] = [
    ("`bigserial` id, `published_at timestamptz` NULL until sent",
     lambda: _shape("sequence", SERIAL, MARKER)),
    ("identity id (`GENERATED ALWAYS`)", lambda: _shape("identity", None, MARKER)),
    ("bigint ids the application supplies (snowflake), `id_kind = application`",
     lambda: _shape("application", None, MARKER)),
    ("bigint ids with no default and no setting", lambda: _shape("none", None, MARKER)),
    ("uuid ids the application supplies", lambda: _shape("uuid", None, MARKER)),
    ("a flag as the marker: `published smallint NOT NULL DEFAULT 0`",
     lambda: _shape("sequence", SERIAL, _column("published", "smallint", "0"))),
    ("a flag as the marker: `published boolean NOT NULL DEFAULT false`",
     lambda: _shape("sequence", SERIAL, _column("published", "boolean", "false"))),
    ("no unique index on the id", lambda: _shape("sequence", SERIAL, MARKER, keys=())),
    ("a foreign key from another table into the outbox",
     lambda: _shape("sequence", SERIAL, MARKER, foreign_keys_in=(REFERENCING,))),
    ("rows deleted on delivery (1,000 inserted, 1,000 deleted, none updated)",
     lambda: _shape("sequence", SERIAL, MARKER, deletes=1000)),
]  # fmt: skip


def _verdicts(pattern: str) -> list[str]:
    """What `plan --pattern <pattern>` says of each sample shape: judged by the same code, so
    the runbook cannot tell a reader something `plan` no longer does."""
    lines = ["| your table | what `plan` says |", "|---|---|"]
    for shape, build in SHAPES:
        facts, spec = build()
        judge(facts, spec, pattern)
        codes = ", ".join(f"`{f.code}`" for f in facts.blockers)
        notes = ", ".join(f"`{f.code}`" for f in facts.notes)
        verdict = f"**blocker**: {codes}" if codes else "not a blocker" + (
            f" (notes: {notes})" if notes else "")  # fmt: skip
        lines.append(f"| {shape} | {verdict} |")
    return lines


def render_playbook(name: str, spec: OutboxSpec | None = None) -> str:
    """The runbook of pattern `name` for `spec` (default: the spec's names)."""
    spec = spec or OutboxSpec()
    pattern = build_pattern(name, spec, BuildOptions(include_optional=True))
    lines = [
        f"# {pattern.acronym} playbook: {pattern.title}",
        "",
        f"<!-- Generated from the pattern catalog by `{REGENERATE}`; do not edit by hand. -->",
        "",
        pattern.summary,
        "",
        "## When this is the pattern",
        "",
        f"- Publication may pause for a few minutes: {_yes(pattern.pause_publication)}",
        f"- The old rows must become part of the partitioned table: {_yes(pattern.keep_old_rows)}",
        f"- Every published row must be readable from the final table at all times: "
        f"{_yes(pattern.immediate_access)}",
        "",
        f"`outbox-migrate wizard {_wizard_flags(pattern)}` recommends it.",
        "",
        "## Before you start",
        "",
        f"- Run `outbox-migrate plan --pattern {pattern.name} --dsn <DSN>` against production. "
        "It judges your table as it is — its columns, ids, constraints, grants, triggers, "
        "publications and its own statistics — and lists every blocker at once, each with the "
        'fix to run (docs/plan.md, "With a DSN", has the table of blockers). What it says of '
        "some common shapes, judged by the same code when this runbook was generated:",
        "",
        *_verdicts(pattern.name),
        "",
        "- Read its warnings: a logical-replication publication on the outbox gets the "
        "unpublished partition in V2, and the plan shows per phase what its consumer receives "
        "and must change (a new relation name; an INSERT is a new message only when the "
        "publication column is NULL); triggers and outgoing foreign keys are not carried over.",
        "- Every step sets a short `lock_timeout`: when it cannot get its lock it fails and "
        "changes nothing; run it again when the blocking transaction is gone.",
    ]
    copiers = ", ".join(f"`{s.id}`" for s in pattern.steps() if s.kind in ROW_COPYING_KINDS)
    if copiers:
        lines.append(
            f"- The old table must have no generated column: {copiers} "
            "copies whole rows, which PostgreSQL refuses for a generated column (`plan --dsn` "
            "warns about it)."
        )
    if pattern.point_of_no_return:
        lines.append(
            f"- Point of no return: `{pattern.point_of_no_return}`. Every step before it can "
            "be reversed; that one cannot."
        )
    else:
        lines.append("- No point of no return: every step can be reversed.")
    lines += [
        "",
        "## Timeline",
        "",
        "| phase | kind | application | database steps |",
        "|---|---|---|---|",
    ]
    for phase in pattern.phases:
        steps = ", ".join(f"`{s.kind}`" for s in phase.steps) or "none"
        app = phase.app.describe(spec.table, spec.partitioned_table)
        lines.append(f"| {phase.name} | {phase.kind.value} | {app} | {steps} |")
    transactional = sum(1 for s in pattern.steps() if s.tx is TxMode.TRANSACTION)
    lines += [
        "",
        f"{len(pattern.steps())} steps, {transactional} of them transactional "
        "(all statements of a step commit together, or none do).",
        "",
        "## Phase by phase",
        "",
    ]
    for index, phase in enumerate(pattern.phases):
        _phase_section(pattern, index, phase, spec, lines)
    lines += ["## Reference: every step in full", ""]
    # Drop the reference's own title and summary: the playbook already starts with them.
    lines.append(render_markdown(pattern, spec).split("\n## Phases\n", 1)[1].lstrip("\n"))
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["render_playbook"]
