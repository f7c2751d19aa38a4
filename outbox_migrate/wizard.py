"""The decision flowchart (docs/wizard.md) as a pure function: three answers → a pattern, with
reasons; `measure` adds facts from a live database and what they mean for the choice.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import UsageError

if TYPE_CHECKING:
    from outbox_migrate.advisory.table_facts import TableFacts

QUESTIONS = {
    "pause": "Can publication of messages pause for a few minutes during the migration?",
    "keep_old_rows": "Must the old outbox's rows become part of the new partitioned table?",
    "immediate_access": "Must every published row be readable from the final table at all "
    "times (no copy window)?",
}


@dataclass(frozen=True)
class Answers:
    pause: bool
    keep_old_rows: bool
    immediate_access: bool | None = None
    """Only asked when publication cannot pause and the old rows must join."""


@dataclass(frozen=True)
class Recommendation:
    pattern: str
    reasons: list[str]
    rejected: dict[str, str]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def needs_immediate_access_question(pause: bool, keep_old_rows: bool) -> bool:
    return not pause and keep_old_rows


def recommend(answers: Answers) -> Recommendation:
    """Walk the flowchart. Raises `UsageError` when question 3 is needed but unanswered."""
    pause, keep = answers.pause, answers.keep_old_rows
    if needs_immediate_access_question(pause, keep) and answers.immediate_access is None:
        raise UsageError(
            "publication cannot pause and the old rows must join: also answer "
            "--immediate-access or --no-immediate-access"
        )
    reasons: list[str] = []
    if pause:
        reasons.append(
            "publication may pause, so new messages can wait in the partitioned table while "
            "the old one drains: no table-switching publisher is needed"
        )
        if keep:
            pattern = "copra"
            reasons.append(
                "the old rows must join, so the old table is attached as the DEFAULT "
                "(published) partition after a NOT VALID CHECK is validated — no long lock"
            )
        else:
            pattern = "cop"
            reasons.append("the old rows may stay in their own table, so nothing is attached")
    else:
        reasons.append(
            "publication must not pause, so V2 publishes from the old table until it is "
            "drained and no writer is left, then switches to the partitioned table"
        )
        if not keep:
            pattern = "hop"
            reasons.append("the old rows may stay in their own table, so nothing is attached")
        elif answers.immediate_access:
            pattern = "hopia"
            reasons.append(
                "every published row must stay readable, so a trigger copies each row "
                "published into the new table into the old one, which then replaces the "
                "published partition in one catalog-only swap"
            )
        else:
            pattern = "hoper"
            reasons.append(
                "the old rows must join but may be incomplete for a while, so the old table "
                "replaces the published partition and a throttled job copies the rows "
                "published meanwhile"
            )
    return Recommendation(pattern, reasons, _rejections(pattern, answers))


def _rejections(chosen: str, a: Answers) -> dict[str, str]:
    why: dict[str, str] = {}
    no_pause = "publication must not pause, and it pauses between V2 and its last deploy"
    needs_keep = "the old rows must join the partitioned table, and it leaves them apart"
    more_than_needed = "more moving parts than your answers require"
    if a.pause:
        why["hop"] = more_than_needed + " (a switching publisher is only for no-pause)"
        why["hoper"] = more_than_needed + " (switching publisher and a copy job)"
        why["hopia"] = more_than_needed + " (switching publisher and a copy trigger)"
        if a.keep_old_rows:
            why["cop"] = needs_keep
        else:
            why["copra"] = more_than_needed + " (attaching the old table is not required)"
    else:
        why["cop"] = no_pause
        why["copra"] = no_pause
        if not a.keep_old_rows:
            why["hoper"] = more_than_needed + " (the old rows need not join)"
            why["hopia"] = more_than_needed + " (the old rows need not join)"
        else:
            why["hop"] = needs_keep
            if a.immediate_access:
                why["hoper"] = (
                    "published rows would be missing from the final table until the "
                    "copy-back job finishes"
                )
            else:
                why["hopia"] = (
                    more_than_needed + " (no need for instant access: a copy job is "
                    "simpler than a trigger on the hot path)"
                )
    why.pop(chosen, None)
    return why


@dataclass(frozen=True)
class Measurements:
    server_version: str
    total_bytes: int
    heap_bytes: int
    row_estimate: int
    unpublished: int
    inserts_per_s: float
    publishes_per_s: float
    window_s: float
    publications: list[str]
    foreign_keys_in: list[str]
    blockers: list[str]
    id_column: str = ""
    """The primary key, when the configured id column is missing: the id `plan` suggests,
    carried into the `Next:` command."""
    table: str = "outbox"
    """The table measured, as the user names it (schema-qualified outside `public`)."""


def measure(dsn: str, spec: OutboxSpec, window_s: float = 2.0, pattern: str = "") -> Measurements:
    """Sample the live outbox: size, backlog, insert and publish rates, CDC, FKs, version,
    and the blockers `plan` would name for `pattern` (the recommended one)."""
    from outbox_migrate.advisory.introspect import introspect
    from outbox_migrate.db import connect

    with connect(dsn) as conn:
        facts = introspect(conn, spec, pattern)
        first = _counters(conn, spec, facts.sequence)
        time.sleep(window_s)
        second = _counters(conn, spec, facts.sequence)
    return Measurements(
        server_version=facts.server_version_text,
        total_bytes=facts.total_bytes,
        heap_bytes=facts.heap_bytes,
        row_estimate=facts.row_estimate,
        unpublished=facts.unpublished,
        table=spec.table if spec.schema == "public" else f"{spec.schema}.{spec.table}",
        inserts_per_s=max(second[0] - first[0], 0) / window_s,
        publishes_per_s=max(second[1] - first[1], 0) / window_s,
        window_s=window_s,
        publications=facts.publications,
        foreign_keys_in=[f"{n} on {t}" for n, t in facts.foreign_keys_in],
        blockers=[f"{b.message}: {b.remedy}" for b in facts.blockers],
        id_column=_suggested_id(facts, spec),
    )


def _suggested_id(facts: TableFacts, spec: OutboxSpec) -> str:
    key = facts.primary_key()
    return key[0] if facts.column(spec.id_column) is None and len(key) == 1 else ""


def _counters(conn: Any, spec: OutboxSpec, sequence: str | None) -> tuple[int, int]:
    """(rows inserted, rows updated), from the sources docs/wizard.md names; nothing here
    fails, whatever the id column is: introspection named the sequence, or there is none."""
    from psycopg import sql

    from outbox_migrate.patterns.names import Names

    reg = Names(spec).reg(spec.table)
    conn.execute("SELECT pg_stat_clear_snapshot()")  # the counters freeze in a transaction
    stats = sql.SQL("(SELECT {col} FROM pg_stat_user_tables WHERE relid = to_regclass({reg}))")
    inserts = stats.format(col=sql.SQL("n_tup_ins"), reg=reg)
    if sequence:  # a role that may not read the sequence falls back to the counters
        inserts = sql.SQL(
            "coalesce(CASE WHEN has_sequence_privilege({s}, 'SELECT,USAGE') THEN "
            "pg_sequence_last_value({s}) END, {i})"
        ).format(s=sql.Literal(sequence), i=inserts)
    row = conn.execute(
        sql.SQL("SELECT coalesce({}, 0), coalesce({}, 0)").format(
            inserts, stats.format(col=sql.SQL("n_tup_upd"), reg=reg)
        )
    ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def interpret(m: Measurements, pattern: str) -> list[str]:
    """How the measured facts bear on the choice (printed under the recommendation)."""
    from outbox_migrate.advisory.table_facts import ASSUMED_SCAN_BYTES_PER_S

    notes: list[str] = []
    scan_s = m.heap_bytes / ASSUMED_SCAN_BYTES_PER_S
    notes.append(
        f"{m.table}: ~{m.row_estimate:,} rows, {m.total_bytes / 1024 / 1024:,.1f} MiB, "
        f"{m.unpublished:,} unpublished; {m.inserts_per_s:,.1f} inserts/s and "
        f"{m.publishes_per_s:,.1f} publishes/s over {m.window_s:g} s (PostgreSQL "
        f"{m.server_version})"
    )
    if pattern in ("copra", "hoper", "hopia"):
        notes.append(
            f"VALIDATE of the CHECK reads the whole old table: ~{scan_s:,.1f} s at 200 MB/s, "
            "without blocking writers; a naive ATTACH would hold ACCESS EXCLUSIVE that long"
        )
    if pattern in ("cop", "copra"):
        notes.append(
            "the pause lasts from V2's rollout until the last deploy; at "
            f"{m.inserts_per_s:,.1f} inserts/s, each minute of pause leaves "
            f"~{m.inserts_per_s * 60:,.0f} messages waiting"
        )
    if pattern == "hoper":
        notes.append(
            f"copy-back will copy every row published between V2 and V4: at "
            f"{m.publishes_per_s:,.1f} publishes/s that is ~{m.publishes_per_s * 3600:,.0f} "
            "rows per hour of rollout"
        )
    if m.publications:
        notes.append(
            f"CDC: publications {', '.join(m.publications)} include the outbox; V2 adds the "
            "unpublished partition to them (step publish-unpublished-partition), and `plan "
            "--dsn` shows per phase what their consumers receive and must change"
        )
    notes.extend(f"blocker: {b}" for b in m.blockers)
    return notes
