"""`plan`: a pattern rendered for one schema as JSON, Markdown or psql-runnable SQL. Pure
rendering; the table view for terminals lives in the CLI, the only layer that may import rich.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from outbox_migrate.advisory.cdc_view import phase_views, render_lines
from outbox_migrate.advisory.introspect import TableFacts
from outbox_migrate.config import OutboxSpec
from outbox_migrate.offline import cdc_guard, step_sql
from outbox_migrate.patterns.model import Pattern, Phase, Step

PHASE_MARKER = "-- phase: "
MARKER_KEYS = ("unpublished_value", "published_value", "status_column", "status_published_value")
"""Spec keys `plan` shows only when set: a flag marker's values and a status column."""
SPEC_KEYS = (
    "schema", "table", "partitioned_table", "unpublished_partition", "published_partition",
    "id_column", "published_column", "id_headroom", "id_kind", "created_column",
    "payload_column", "key_column", "event_type_column", "headers_column",
)  # fmt: skip
"""The spec keys `plan` always shows, in its order (the marker keys go after the 7th)."""
COLUMN_KEYS = ("name", "type", "not_null", "default", "identity", "collation")


def step_document(step: Step) -> dict[str, Any]:
    return {
        "id": step.id,
        "kind": step.kind,
        "summary": step.summary,
        "app_before": step.app_before,
        "app_after": step.app_after,
        "transaction": step.tx.value,
        "sql": step.sql_texts(),
        "locks": [{"relation": lock.relation, "mode": lock.mode.sql_name} for lock in step.locks],
        "catalog_only": step.catalog_only,
        "scan": step.scan or "none",
        "statement_timeout_ms": step.statement_timeout_ms,
        "preconditions": [
            {"name": c.name, "description": c.description, "at": c.at.value}
            | ({"kept_by": c.kept_by} if c.kept_by else {})
            for c in step.preconditions
        ],
        "creates": [obj.name for obj in step.creates],
        "postcondition": [
            {"name": c.name, "description": c.description} for c in step.postcondition
        ],
        "reversible": step.reversible,
        "reverse_sql": [s.as_string(None) for s in step.reverse or ()],
        "reverse_note": step.reverse_note,
        "optional": step.optional,
        "notes": list(step.notes),
        "checksum": step.checksum(),
    }


def facts_document(facts: TableFacts, spec: OutboxSpec) -> dict[str, Any]:
    return {
        "server_version": facts.server_version_text,
        "table": f"{facts.schema}.{facts.table}",
        "columns": [{key: getattr(c, key) for key in COLUMN_KEYS} for c in facts.columns],
        "id_kind": facts.id_kind(spec),
        **(
            {"claim_order": spec.claim_order, "gate_sequence": spec.gate_sequence}
            if facts.id_kind(spec) == "application"
            else {}
        ),
        "id_sequence": facts.sequence,
        "max_id": facts.max_id,
        "sequence_last_value": facts.sequence_last_value,
        "identity_start": facts.identity_start(spec.id_headroom),
        "row_estimate": facts.row_estimate,
        "unpublished": facts.unpublished,
        "total_bytes": facts.total_bytes,
        "estimated_validate_s": round(facts.estimated_scan_s(), 1),
        "indexes": [name for name, _ in facts.indexes],
        "triggers": [name for name, _ in facts.triggers],
        "foreign_keys_in": [f"{n} on {t}" for n, t in facts.foreign_keys_in],
        "publications": facts.publications,
        "publication_details": [asdict(p) for p in facts.publication_details],
        "new_tables": facts.new_table_state,
        "blockers": [vars(b) for b in facts.blockers],
        "warnings": [vars(w) for w in facts.warnings],
        "notes": [vars(n) for n in facts.notes],
        "objects": [vars(o) for o in facts.objects],
    }


def blocked_document(pattern: str, facts: TableFacts) -> dict[str, Any]:
    """What `plan --format json` prints when blockers stop the plan: each with its `fix_sql`
    (a fix a tool can apply, then plan again); no phases, since none may run yet."""
    return {
        "pattern": pattern,
        "table": f"{facts.schema}.{facts.table}",
        "blocked": True,
        "blockers": [vars(b) for b in facts.blockers],
        "warnings": [vars(w) for w in facts.warnings],
        "notes": [vars(n) for n in facts.notes],
    }


def duplicate_ids_text(pattern: Pattern, spec: OutboxSpec) -> str:
    """What an INSERT of an id already used does once the partitioned table is in use: the
    parent can have no primary key on the id alone, so only a DEFAULT partition that is the
    old table still carries one — and there it meets the relay's mark, not the INSERT."""
    if pattern.keep_old_rows:
        return (
            f"Duplicate ids: {spec.table} becomes the DEFAULT (published) partition and keeps "
            f"its primary key, but {spec.unpublished_partition} has none, so an INSERT of an id "
            "already used is no longer refused; the relay publishes that row, cannot move it "
            "into the published partition (unique violation), and after --max-attempts keeps "
            "it in the dead-letter table and deletes it from the outbox."
        )
    return (
        f"Duplicate ids: {spec.partitioned_table} has no primary key (none is possible on the "
        "id alone), so an INSERT of an id already used is not refused; the relay publishes "
        "both rows, and consumers that de-duplicate on outbox-id drop the second."
    )


def plan_document(
    pattern: Pattern, spec: OutboxSpec, facts: TableFacts | None = None
) -> dict[str, Any]:
    """Everything `plan` shows, as plain data (the JSON format, and the source of the others)."""
    cdc = phase_views(pattern, spec, facts.publication_details) if facts is not None else {}
    return {
        "pattern": pattern.name,
        "acronym": pattern.acronym,
        "title": pattern.title,
        "summary": pattern.summary,
        "requirements": {
            "publication_may_pause": pattern.pause_publication,
            "old_rows_join_partitioned_table": pattern.keep_old_rows,
            "published_rows_always_readable": pattern.immediate_access,
        },
        "spec": {
            **{key: getattr(spec, key) for key in SPEC_KEYS[:7]},
            # a flag marker's values and a status column, only when there are any
            **{key: getattr(spec, key) for key in MARKER_KEYS if getattr(spec, key)},
            **{key: getattr(spec, key) for key in SPEC_KEYS[7:]},
            "metadata_columns": list(spec.metadata_columns),
        },
        "point_of_no_return": pattern.point_of_no_return or None,
        "duplicate_ids": duplicate_ids_text(pattern, spec),
        "facts": facts_document(facts, spec) if facts is not None else None,
        "phases": [
            {
                "name": phase.name,
                "kind": phase.kind.value,
                "title": phase.title,
                "application": phase.app.describe(spec.table, spec.partitioned_table),
                "instructions": list(phase.instructions),
                "steps": [step_document(step) for step in phase.steps],
                **(
                    {
                        "cdc": [view.to_json() for view in cdc[phase.name]],
                        "cdc_text": render_lines(cdc, phase.name),
                    }
                    if cdc.get(phase.name)
                    else {}
                ),
            }
            for phase in pattern.phases
        ],
    }


def render_sql(pattern: Pattern, spec: OutboxSpec, lock_timeout_ms: int = 200) -> str:
    """psql-runnable SQL, one `-- phase: NAME` section per phase (docs/plan.md)."""
    lines = [
        f"-- outbox-migrate plan: {pattern.acronym} ({pattern.title})",
        f"-- {spec.schema}.{spec.table} -> {spec.schema}.{spec.partitioned_table}",
        "-- Apply one phase at a time, between deploys: psql -v ON_ERROR_STOP=1 -f <phase>.sql",
        "",
    ]
    for phase in pattern.phases:
        lines += [f"{PHASE_MARKER}{phase.name}", *(f"-- {text}" for text in phase.instructions)]
        if not phase.steps:
            lines.append("-- (no database steps in this phase)")
        for step in phase.steps:
            lines += ["", f"-- step: {step.id}: {step.summary}"]
            lines += step_sql(
                step, lock_timeout_ms, schema=spec.schema, parent=spec.partitioned_table
            )
            guard = cdc_guard(pattern, step, spec)
            if guard:
                lines += ["", f"-- check: no publication lists {spec.table} without "
                          f"{spec.unpublished_partition} (CDC consumers)", *guard]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def split_sql_phases(text: str) -> dict[str, str]:
    """Inverse of the phase markers: phase name → its SQL (for tests and scripted applies)."""
    phases: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(PHASE_MARKER):
            current = phases.setdefault(line[len(PHASE_MARKER) :].strip(), [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(body) + "\n" for name, body in phases.items()}


def _md_step(step: Step, lines: list[str]) -> None:
    locks = ", ".join(f"{lock.mode.sql_name} on `{lock.relation}`" for lock in step.locks)
    timeout = (
        "unlimited" if step.statement_timeout_ms is None else f"{step.statement_timeout_ms} ms"
    )
    catalog_only = " (catalog-only, independent of table size)" if step.catalog_only else ""
    lines += [
        f"#### `{step.id}`{' (optional)' if step.optional else ''}", "", step.summary + ".", "",
        f"- Application before: {step.app_before}",
        f"- Application after: {step.app_after}",
        f"- Transaction: {step.tx.value}; statement_timeout {timeout}",
        f"- Locks: {locks or 'none'}{catalog_only}",
        f"- Scan: {step.scan or 'none'}",
    ]  # fmt: skip
    if step.preconditions:
        lines.append("- Preconditions:")
        lines.extend(f"  - {c.description} (`{c.name}`)" for c in step.preconditions)
    if step.postcondition:
        lines.append("- Done when: " + "; ".join(c.description for c in step.postcondition))
    rollback = step.reverse_note if step.reversible else f"no — {step.reverse_note}"
    lines.append(f"- Rollback: {rollback}")
    lines.extend(f"- Note: {note}" for note in step.notes)
    if step.statements:
        lines += ["", "```sql", *(text.rstrip(";") + ";" for text in step.sql_texts()), "```"]
    lines.append("")


def _md_phase(
    phase: Phase, spec: OutboxSpec, lines: list[str], cdc: list[str] | None = None
) -> None:
    kind = "deploy" if phase.kind.value == "deploy" else "job"
    lines += [
        f"### {phase.name} ({kind}): {phase.title}", "",
        f"Application: {phase.app.describe(spec.table, spec.partitioned_table)}.", "",
        *(f"- {text}" for text in phase.instructions), "",
    ]  # fmt: skip
    if cdc:
        lines += ["```text", *cdc, "```", ""]
    if not phase.steps:
        lines += ["No database steps in this phase.", ""]
    for step in phase.steps:
        _md_step(step, lines)


def _id_line(doc: dict[str, Any]) -> str:
    kind = doc["id_kind"]
    if kind == "application":
        return (
            "- ids supplied by the application: no identity, no headroom; the relay claims "
            f"by {doc.get('claim_order', 'id')}; the deploy gates watch "
            f"{doc.get('gate_sequence', 'the gate sequence')} (installed in V2)"
        )
    source = f" from {doc['id_sequence']}" if kind == "sequence" else ""
    return (
        f"- ids: {kind}{source}; max id {doc['max_id']}, new identity starts at "
        f"{doc['identity_start']:,}"
    )


def render_markdown(pattern: Pattern, spec: OutboxSpec, facts: TableFacts | None = None) -> str:
    lines = [f"# {pattern.acronym}: {pattern.title}", "", pattern.summary, ""]
    lines += [duplicate_ids_text(pattern, spec), ""]
    if facts is not None:
        doc = facts_document(facts, spec)
        lines += [
            "## Your outbox",
            "",
            f"- PostgreSQL {doc['server_version']}, `{doc['table']}`: ~{doc['row_estimate']:,} "
            f"rows, {doc['total_bytes']:,} bytes, {doc['unpublished']:,} unpublished",
            _id_line(doc),
            f"- VALIDATE scan estimate: ~{doc['estimated_validate_s']} s",
        ]
        lines += [f"- **Blocker**: {b.message} — {b.remedy}" for b in facts.blockers]
        lines += [f"- Warning: {w.message} — {w.remedy}" for w in facts.warnings]
        lines += [f"- Note: {n.message} — {n.remedy}" for n in facts.notes]
        lines.append("")
        if facts.objects:
            lines += [f"## Objects on `{facts.table}` and what happens to each", ""]
            lines += [f"- {o.kind} `{o.name}`: {o.fate}" for o in facts.objects]
            lines.append("")
    lines += ["## Phases", ""]
    cdc = phase_views(pattern, spec, facts.publication_details) if facts is not None else {}
    for phase in pattern.phases:
        _md_phase(phase, spec, lines, render_lines(cdc, phase.name))
    return "\n".join(lines).rstrip() + "\n"
