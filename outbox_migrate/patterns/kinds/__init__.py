"""Step kinds: the code behind the catalog's data, one module per family of kinds. A kind is a
function `(ctx, params) -> Step` registered under the name pattern files use; it builds inert
`Step`s and never touches a database.
"""

from __future__ import annotations

from collections.abc import Mapping

from outbox_migrate.patterns.kinds.base import REGISTRY, StepBuilder


def load_all() -> Mapping[str, StepBuilder]:
    """Import every kind module so the registry is complete."""
    from outbox_migrate.patterns.kinds import (  # noqa: F401
        attach,
        copy_rows,
        dead_letter_tables,
        gate_sequence,
        guard,
        original_name,
        partitioned_table,
        publication,
    )

    return REGISTRY
