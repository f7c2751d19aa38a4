"""`Finding`: one blocker, warning or note of `plan` — what was found and what to do.

Its own module so that the judges beside introspect.py (lost_semantics.py) can make findings
without importing introspect.py, which calls them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """A blocker or warning: what was found and what to do."""

    code: str
    message: str
    remedy: str
