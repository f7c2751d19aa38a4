"""Step kinds: the code behind the catalog's data. One module per family of kinds.

A kind is a function `(ctx, params) -> Step` registered under its name; pattern files refer
to kinds by that name. Kinds build inert `Step` objects and never touch a database.
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
