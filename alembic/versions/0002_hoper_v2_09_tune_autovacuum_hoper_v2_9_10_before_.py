"""tune-autovacuum: HOPER V2 9/10, before deploying V2 (outbox-migrate)

Revision ID: 0002_hoper_v2_09
Revises: 0002_hoper_v2_08
Create Date: 2026-11-28 04:35:11.026923

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
import outbox_migrate.alembic_ext  # noqa: F401 - registers op.outbox_step and friends

# revision identifiers, used by Alembic.
revision: str = '0002_hoper_v2_09'
down_revision: Union[str, Sequence[str], None] = '0002_hoper_v2_08'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.outbox_step(
        'hoper.v2.tune-autovacuum',
        spec={
            'schema': 'public',
            'table': 'outbox',
            'partitioned_table': 'outbox_new',
            'unpublished_partition': 'outbox_unpublished',
            'published_partition': 'outbox_published',
            'id_column': 'id',
            'published_column': 'published_at',
            'id_headroom': 1000000,
            'created_column': 'created_at',
            'payload_column': 'payload',
            'key_column': 'message_key',
            'event_type_column': 'event_type',
            'headers_column': 'headers',
            'metadata_columns': (),
            'id_kind': 'database',
            'order_column': '',
            'unpublished_guard': True,
        },
        in_revision_transaction=True,
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.outbox_reverse_step(
        'hoper.v2.tune-autovacuum',
        spec={
            'schema': 'public',
            'table': 'outbox',
            'partitioned_table': 'outbox_new',
            'unpublished_partition': 'outbox_unpublished',
            'published_partition': 'outbox_published',
            'id_column': 'id',
            'published_column': 'published_at',
            'id_headroom': 1000000,
            'created_column': 'created_at',
            'payload_column': 'payload',
            'key_column': 'message_key',
            'event_type_column': 'event_type',
            'headers_column': 'headers',
            'metadata_columns': (),
            'id_kind': 'database',
            'order_column': '',
            'unpublished_guard': True,
        },
        in_revision_transaction=True,
    )
