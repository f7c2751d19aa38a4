"""The relay's sources with the flag marker resolved: a flag's values come from the settings
or the column's DEFAULT (marker_catalog.py), which only the live database knows, so the
sources built from the settings are rebuilt once the relay has a session. No claiming here.
"""

from __future__ import annotations

from typing import Any

from outbox_migrate import marker_catalog
from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.switching import SourceState


def resolved(conn: Any, spec: OutboxSpec, state: SourceState) -> tuple[OutboxSpec, SourceState]:
    """The spec and the sources to claim from; the same objects for a timestamp marker. A
    nullable flag is accepted: only partitioning needs NOT NULL."""
    found = marker_catalog.resolve(conn, spec, to_partition=False)
    if found == spec:
        return spec, state
    return found, SourceState(found, state.mode, state.gate, state.old_app)
