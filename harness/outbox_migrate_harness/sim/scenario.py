"""What a simulation run does: the pattern, the load, the rollout timing. Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns.model import Phase, Table
from outbox_migrate.relay.options import Mode

APP_NAME_PREFIX = "demo-app"
"""application_name of simulated instances: `demo-app/V2/writer-0` — what the deploy gates
and the switching relay's `sessions` gate look for."""


@dataclass(frozen=True)
class Scenario:
    pattern: str
    rate_per_s: int = 500
    duration_s: float = 40.0
    relays: int = 2
    """Relays, and writers, of each application version."""
    writers: int = 2
    wrong_choreography: bool = False
    """Deploy V3's database steps while a V1 writer still runs: the runner must refuse."""
    lock_timeout_ms: int = 200
    gate_window_s: float = 0.5
    batch_size: int = 200
    spec: OutboxSpec = field(default_factory=OutboxSpec)
    """The outbox's names. The demo uses the spec's table; `rehearse` a copy of the user's."""
    insert_sql: str = ""
    """The application's INSERT, `{table}` standing for the table it writes to and `%(key)s`
    for the instance's unique message key; empty: the spec table's demo INSERT. With
    `identity="id"` it must end with `RETURNING <id>`."""
    identity: str = "key"
    """How a delivery is matched to what a writer committed: by the message key column
    ("key", the demo's), or by the outbox id the INSERT returned ("id", for tables whose key
    column is missing or not text)."""

    @property
    def segment_s(self) -> float:
        """Time each version runs alone before the next deploy starts (duration spread over
        the pattern's deploys)."""
        deploys = {"cop": 3, "copra": 4, "hop": 3, "hoper": 4, "hopia": 4}[self.pattern]
        return max(2.0, self.duration_s / (deploys * 1.5))

    @property
    def coexist_s(self) -> float:
        return max(1.0, self.segment_s / 2)


def relay_mode(phase: Phase) -> Mode | None:
    """How a version's relay runs, by the table it publishes from; None: it has no relay."""
    return {
        Table.OLD: Mode.flat,
        Table.NEW: Mode.partitioned,
        Table.OLD_THEN_NEW: Mode.switching,
    }.get(phase.app.publishes_from)


def app_name(version: str, role: str, index: int) -> str:
    return f"{APP_NAME_PREFIX}/{version}/{role}-{index}"
