"""Step kinds: the code behind the catalog's data. One module per family of kinds.

A kind is a function `(ctx, params) -> Step` registered under its name; pattern files refer
to kinds by that name. Kinds build inert `Step` objects and never touch a database.
"""

from __future__ import annotations

from collections.abc import Mapping

from outbox_migrate.patterns.kinds.base import (
    CATALOG_TIMEOUT_MS,
    CREATE_TIMEOUT_MS,
    REGISTRY,
    SCAN_GUARD_TIMEOUT_MS,
    BuildContext,
    StepBuilder,
    kind,
    make_step,
)


def load_all() -> Mapping[str, StepBuilder]:
    """Import every kind module so the registry is complete."""
    from outbox_migrate.patterns.kinds import (  # noqa: F401
        attach,
        check_constraint,
        copy_trigger,
        dead_letter_tables,
        gate,
        gate_sequence,
        guard,
        identity,
        jobs,
        notify,
        old_triggers,
        original_name,
        partitioned_table,
        publication,
        tuning,
    )

    return REGISTRY


__all__ = [
    "CATALOG_TIMEOUT_MS",
    "CREATE_TIMEOUT_MS",
    "REGISTRY",
    "SCAN_GUARD_TIMEOUT_MS",
    "BuildContext",
    "StepBuilder",
    "kind",
    "load_all",
    "make_step",
]
