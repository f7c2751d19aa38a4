"""What an existing CDC consumer of the old outbox sees in each phase (shown by `plan`).

Pure: derived from the built pattern (which steps have run by the end of each phase) and the
introspected publications. The rule a consumer can always rely on, whatever the phase and
the publication's shape: **an INSERT whose publication column is NULL is a new message**;
every other INSERT on the stream is a row the migration or the relay moved or copied (it has
its publication time set) and must not be emitted again.

Facts behind the wording (PostgreSQL 14-18, shown by tests/integration/relay/cdc/
test_publication_shapes.py and tests/integration/patterns/test_cdc_consumer.py): a publishing
mark on the partitioned outbox is a cross-partition UPDATE, decoded as a DELETE from the
unpublished partition and an INSERT into the partition that receives the row; each half
reaches the stream only if that partition is published (leaf by leaf, or under the parent's
name when the publication has `publish_via_partition_root = true`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import marker
from outbox_migrate.patterns.model import Pattern, PhaseKind, PublicationFact, Table

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
            _view(phase.name, pub, spec, inserts, attached, copying, phase, kinds_so_far)
            for pub in publications
        ]
        previous_inserts = phase.app.inserts_into
    return views


def _view(
    name: str,
    pub: PublicationFact,
    spec: OutboxSpec,
    inserts: set[Table],
    attached: bool,
    copying: bool,
    phase: Any,
    kinds: set[str],
) -> PhaseView:
    old, unpub, pubd = spec.table, spec.unpublished_partition, spec.published_partition
    new_live = Table.NEW in inserts or "publish-unpublished-partition" in kinds
    messages: list[str] = []
    if Table.OLD in inserts and (s := _streamed(pub, spec, old, attached)):
        messages.append(s)
    if Table.NEW in inserts and (s := _streamed(pub, spec, unpub, attached)):
        messages.append(s)
    also: list[Seen] = []
    publishes = {phase.app.publishes_from}
    marks_old = publishes & {Table.OLD, Table.OLD_THEN_NEW} or Table.OLD in inserts
    if marks_old and pub.update and not attached and (s := _streamed(pub, spec, old, attached)):
        also.append(Seen("UPDATE", s, f"the relay's mark on {old} (row stays in place)"))
    if new_live and (Table.NEW in publishes or Table.OLD_THEN_NEW in publishes or attached):
        target = old if attached else pubd
        if pub.delete and (s := _streamed(pub, spec, unpub, attached)):
            also.append(Seen("DELETE", s, f"the relay's mark moves the row out of {unpub}"))
        if pub.insert and (s := _streamed(pub, spec, target, attached)):
            also.append(Seen("INSERT", s, f"the relay's mark moves the row into {target} "
                             f"({spec.published_column} set): a replay"))  # fmt: skip
    if copying and pub.insert and (s := _streamed(pub, spec, old, attached)):
        also.append(Seen("INSERT", s, f"HOPIA's copy trigger copies each published row into "
                         f"{old} ({spec.published_column} set): a replay"))  # fmt: skip
    copy_back = "copy-back" in {step.kind for step in phase.steps}
    if copy_back and pub.insert and (s := _streamed(pub, spec, old, attached)):
        also.append(Seen("INSERT", s, f"copy-back inserts the detached published rows "
                             f"into {old} ({spec.published_column} set): replays"))  # fmt: skip
    return PhaseView(name, pub.name, list(dict.fromkeys(messages)), also,
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
