"""A flag marker through the relay's bad-row repair: when the mark of one row breaks a
constraint, the batch is marked again in parts (relay/mark_repair.py), each with the flag's
published value. Before, the repair's mark set `sent = now()` and every part failed."""

from __future__ import annotations

import psycopg

from outbox_migrate.config import OutboxSpec
from outbox_migrate.relay.options import Mode, RelayOptions
from outbox_migrate.relay.worker import Relay

from .conftest import Collected

SPEC = OutboxSpec(table="outbox_sent", partitioned_table="outbox_sent_new",
                  unpublished_partition="outbox_sent_unpublished",
                  published_partition="outbox_sent_published", published_column="sent")  # fmt: skip


def test_a_flag_row_whose_mark_a_check_refuses_is_dead_lettered(
    dsn: str, conn: psycopg.Connection, collected: Collected
) -> None:
    conn.execute(
        "CREATE TABLE outbox_sent_new (id bigserial, payload jsonb NOT NULL, created_at "
        "timestamptz NOT NULL DEFAULT now(), sent boolean NOT NULL DEFAULT false) "
        "PARTITION BY LIST (sent)"
    )
    conn.execute(
        "CREATE TABLE outbox_sent_unpublished PARTITION OF outbox_sent_new FOR VALUES IN (false)"
    )
    conn.execute(
        "CREATE TABLE outbox_sent_published PARTITION OF outbox_sent_new "
        "(CONSTRAINT no_publishing_7 CHECK (id <> 7)) DEFAULT"
    )
    conn.execute("INSERT INTO outbox_sent_new (payload) SELECT '{}' FROM generate_series(1, 25)")
    conn.commit()
    options = RelayOptions(mode=Mode.partitioned, until_empty=True, listen=False, batch_size=10,
                           max_attempts=2, poll_interval_s=0.02)  # fmt: skip
    Relay(dsn, collected.factory(), spec=SPEC, options=options).run()
    dead = conn.execute("SELECT id, last_error FROM outbox_dead_letter ORDER BY id").fetchall()
    states = conn.execute(
        "SELECT sent, count(*) FROM outbox_sent_new GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert [d[0] for d in dead] == [7]
    assert "no_publishing_7" in dead[0][1]
    assert states == [(True, 24)]  # the dead-lettered row leaves the outbox
