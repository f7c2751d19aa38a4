"""What an existing CDC consumer of the old outbox sees in each phase (shown by `plan`; the rule
and the table are in docs/patterns.md, "CDC consumers"). Pure: derived from the built pattern
and the introspected publications.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import marker
from outbox_migrate.patterns.model import Pattern, Phase, PhaseKind, PublicationFact, Table

ATTACH_KINDS = frozenset({"swap-default", "attach-old-as-default"})


@dataclass(frozen=True)
class Seen:
    event: str
    relation: str
    cause: str


@dataclass
class PhaseView:
    """One publication's stream during one phase."""

    phase: str
    publication: str
    messages_on: list[str]
    """Relations whose INSERTs (publication column NULL) are new messages."""
    also: list[Seen] = field(default_factory=list)
    """Other row events on the stream, and what causes them."""
    consumer: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _streamed(pub: PublicationFact, spec: OutboxSpec, relation: str, attached: bool) -> str | None:
    """The name under which `relation`'s changes reach the stream, or None if they do not."""
    new_tables = {spec.unpublished_partition, spec.published_partition}
    if pub.covers_new_tables:
        if pub.via_root and (relation in new_tables or (relation == spec.table and attached)):
            return spec.partitioned_table
        return relation
    if relation == spec.table:
        return relation if pub.explicit else None
    return relation if relation == spec.unpublished_partition else None


def phase_views(
    pattern: Pattern, spec: OutboxSpec, publications: tuple[PublicationFact, ...] | list[Any]
) -> dict[str, list[PhaseView]]:
    """Phase name → one view per publication covering the old table."""
    views: dict[str, list[PhaseView]] = {}
    kinds_so_far: set[str] = set()
    previous_inserts = Table.OLD
    for phase in pattern.phases:
        kinds_so_far |= {step.kind for step in phase.steps}
        attached = bool(kinds_so_far & ATTACH_KINDS)
        copying = "install-copy-trigger" in kinds_so_far and not attached
        inserts = {phase.app.inserts_into, previous_inserts}
        if phase.kind is PhaseKind.JOB:
            inserts = {phase.app.inserts_into}
        views[phase.name] = [
            _view(pub, spec, phase, inserts, attached, copying, kinds_so_far)
            for pub in publications
        ]
        previous_inserts = phase.app.inserts_into
    return views


def _view(
    pub: PublicationFact,
    spec: OutboxSpec,
    phase: Phase,
    inserts: set[Table],
    attached: bool,
    copying: bool,
    kinds: set[str],
) -> PhaseView:
    old, unpub, pubd = spec.table, spec.unpublished_partition, spec.published_partition
    streamed = {rel: _streamed(pub, spec, rel, attached) for rel in (old, unpub, pubd)}
    messages = [
        s for table, rel in ((Table.OLD, old), (Table.NEW, unpub))
        if table in inserts and (s := streamed[rel]) is not None
    ]  # fmt: skip
    also: list[Seen] = []

    def seen(wanted: bool, event: str, relation: str, cause: str) -> None:
        if wanted and (shown := streamed[relation]) is not None:
            also.append(Seen(event, shown, cause))

    marked = f"({spec.published_column} set)"
    publishes = {phase.app.publishes_from}
    marks_old = bool(publishes & {Table.OLD, Table.OLD_THEN_NEW}) or Table.OLD in inserts
    seen(marks_old and pub.update and not attached, "UPDATE", old,
         f"the relay's mark on {old} (row stays in place)")  # fmt: skip
    new_live = Table.NEW in inserts or "publish-unpublished-partition" in kinds
    if new_live and (publishes & {Table.NEW, Table.OLD_THEN_NEW} or attached):
        target = old if attached else pubd
        seen(pub.delete, "DELETE", unpub, f"the relay's mark moves the row out of {unpub}")
        seen(pub.insert, "INSERT", target,
             f"the relay's mark moves the row into {target} {marked}: a replay")  # fmt: skip
    seen(copying and pub.insert, "INSERT", old, f"HOPIA's copy trigger copies each published "
         f"row into {old} {marked}: a replay")  # fmt: skip
    seen("copy-back" in {step.kind for step in phase.steps} and pub.insert, "INSERT", old,
         f"copy-back inserts the detached published rows into {old} {marked}: replays")  # fmt: skip
    return PhaseView(phase.name, pub.name, list(dict.fromkeys(messages)), also,
                     _advice(pub, spec, messages, also))  # fmt: skip


def _advice(pub: PublicationFact, spec: OutboxSpec, messages: list[str], also: list[Seen]) -> str:
    renamed = [m for m in messages if m != spec.table]
    parts: list[str] = []
    if renamed:
        parts.append(
            f"a consumer filtering on {spec.table} must also accept {', '.join(renamed)} "
            "(e.g. Debezium table.include.list and the router's routing)"
        )
    if any(seen.event == "INSERT" for seen in also):
        parts.append(
            f"emit an INSERT only when {marker.describe_unpublished(spec)}: the other INSERTs are "
            "rows moved or copied after publishing"
        )
    if not parts:
        return "nothing to change"
    return "; ".join(parts)


def render_lines(views: dict[str, list[PhaseView]], phase: str) -> list[str]:
    """Plain-text lines for one phase (terminal and Markdown views)."""
    lines: list[str] = []
    for view in views.get(phase, []):
        lines.append(
            f"CDC {view.publication}: new messages arrive as INSERT on "
            f"{', '.join(view.messages_on) or '(nothing)'}"
        )
        lines.extend(f"  also {s.event} on {s.relation}: {s.cause}" for s in view.also)
        lines.append(f"  consumer: {view.consumer}")
    return lines
