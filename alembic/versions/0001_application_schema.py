"""application schema: customers, orders and the transactional outbox

The outbox is the traditional flat table the HOPER revisions that follow (0002_hoper_*)
migrate to a LIST-partitioned table while the application keeps writing.

Revision ID: 0001
Revises:
Create Date: 2026-11-23 00:00:00

"""

from collections.abc import Sequence

from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        "CREATE TABLE customer ("
        " id int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
        " email text NOT NULL UNIQUE)"
    )
    op.execute(
        "CREATE TABLE orders ("
        " id int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
        " customer_id int8 NOT NULL REFERENCES customer (id),"
        " total numeric(12, 2) NOT NULL,"
        " created_at timestamptz NOT NULL DEFAULT now())"
    )
    # The outbox: written in the same transaction as the order; a relay publishes it.
    op.execute(
        "CREATE TABLE outbox ("
        " id int8 GENERATED ALWAYS AS IDENTITY,"
        " event_type text NOT NULL DEFAULT 'event',"
        " message_key text,"
        " payload json NOT NULL,"
        " created_at timestamptz NOT NULL DEFAULT now(),"
        " published_at timestamptz,"
        " PRIMARY KEY (id))"
    )
    op.execute("CREATE INDEX outbox_unpublished_id_idx ON outbox (id) WHERE published_at IS NULL")


def downgrade() -> None:
    op.execute("DROP TABLE outbox")
    op.execute("DROP TABLE orders")
    op.execute("DROP TABLE customer")
