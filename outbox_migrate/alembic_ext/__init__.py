"""Alembic integration: a pattern's steps as Alembic operations and generated revisions.

Importing it registers the `op.outbox_*` operations; it imports Alembic and SQLAlchemy, so the
CLI imports it lazily.
"""

from outbox_migrate.alembic_ext.ops import (
    AlembicStepError,
    OutboxPhaseOp,
    OutboxStepOp,
    ReverseOutboxPhaseOp,
    ReverseOutboxStepOp,
)

__all__ = [
    "AlembicStepError",
    "OutboxPhaseOp",
    "OutboxStepOp",
    "ReverseOutboxPhaseOp",
    "ReverseOutboxStepOp",
]
