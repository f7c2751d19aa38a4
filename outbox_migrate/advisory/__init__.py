"""The advisory layer: what `plan`, `roles`, the wizard and the runner's admission read from the
catalog and judge before anything runs. It reads and advises, never writes, and nothing below
it imports it. `Finding` (defined with the marker's refusals) is its one vocabulary.
"""

from __future__ import annotations

from outbox_migrate.patterns.marker_catalog import Finding
from outbox_migrate.patterns.names import ident, literal

__all__ = ["Finding", "ident", "literal"]
