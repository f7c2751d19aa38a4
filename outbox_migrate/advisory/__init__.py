"""The advisory layer: what `plan` (and `roles`, the wizard, the runner's admission) reads from
the catalog and judges before anything runs — facts, blockers, warnings and the SQL that fixes
them. It reads and advises; it never writes, and nothing below it (the patterns, the relay)
imports it.

`Finding` is its one vocabulary: a blocker, warning or note — what was found and what to do —
with the quoting every fix it prints goes through (`ident`, `literal`, from patterns/names.py).
Here, so the judges beside introspect.py make findings without importing it; defined in
patterns/marker_catalog.py, whose refusals of a marker column are findings too.
"""

from __future__ import annotations

from outbox_migrate.patterns.marker_catalog import Finding
from outbox_migrate.patterns.names import ident, literal

__all__ = ["Finding", "ident", "literal"]
