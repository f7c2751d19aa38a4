"""Alembic integration: a pattern's steps as Alembic operations and generated revisions.

Importing this package registers `op.outbox_step`, `op.outbox_reverse_step`,
`op.outbox_phase` and `op.outbox_reverse_phase` with Alembic; generated revisions import it.
It imports Alembic and SQLAlchemy, so the CLI imports it lazily.
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
