"""The advisory layer: what `plan` (and `roles`, the wizard, the runner's admission) reads from
the catalog and judges before anything runs — facts, blockers, warnings and the SQL that fixes
them. It reads and advises; it never writes, and nothing below it (the patterns, the relay)
imports it.

`Finding` is its one vocabulary: a blocker, warning or note — what was found and what to do —
with the quoting every fix it prints goes through (`ident`, `literal`, from patterns/names.py).
Here, so the judges beside introspect.py make findings without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from outbox_migrate.patterns.names import ident, literal


@dataclass(frozen=True)
class Finding:
    """A blocker or warning: what was found and what to do."""

    code: str
    message: str
    remedy: str
    fix_sql: str = ""
    """The SQL the remedy prints, verbatim (the tests run it against the table it names):
    empty when the fix is a setting or a decision, not a statement."""


__all__ = ["Finding", "ident", "literal"]
