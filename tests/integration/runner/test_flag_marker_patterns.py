"""Every pattern from V1 to its end through the runner on an outbox whose publication marker
is a flag (`sent boolean NOT NULL DEFAULT false`): the bound, the CHECK that lets ATTACH skip
its scan (COPRA, HOPER, HOPIA run it under the scan guard's statement_timeout), the drained
gates and verify all follow the flag. Before, `plan`/admission refused such a table."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from outbox_migrate.config import load_settings
from outbox_migrate.patterns import PATTERN_NAMES
from outbox_migrate.runner import Runner

NAMES = {"table": "outbox_sent", "partitioned_table": "outbox_sent_new",
         "unpublished_partition": "outbox_sent_unpublished",
         "published_partition": "outbox_sent_published", "published_column": "sent",
         "gate_window_s": 0.1, "lock_budget_s": 10.0}  # fmt: skip


def _publish_all(conn: psycopg.Connection, table: str) -> None:
    """The previous version's relay drained what it published from."""
    conn.execute(sql.SQL("UPDATE {} SET sent = true WHERE NOT sent").format(sql.Identifier(table)))


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_every_pattern_runs_to_the_end_on_a_flag_outbox(name: str, dsn: str) -> None:
    settings = load_settings(NAMES, environ={})
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE outbox_sent (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            "payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), "
            "sent boolean NOT NULL DEFAULT false); "
            "INSERT INTO outbox_sent (payload, sent) "
            "SELECT jsonb_build_object('n', g), g <= 50 FROM generate_series(1, 60) g"
        )
        pattern = Runner(dsn, settings, name).pattern
        for index, phase in enumerate(pattern.phases[1:], start=1):
            previous = pattern.phases[index - 1]
            if previous.app.publishes_from.value in ("old", "old-then-new"):
                _publish_all(conn, "outbox_sent")
            if previous.app.publishes_from.value in ("new", "old-then-new"):
                _publish_all(conn, "outbox_sent_new")
            with Runner(dsn, settings, name) as runner:
                assert runner.run(phase.name).phase == phase.name
            if phase.name == "V2":
                # the new version's row lands in the unpublished partition by its DEFAULT
                conn.execute("INSERT INTO outbox_sent_new (payload) VALUES ('{\"n\": 61}')")
                landed = conn.execute(
                    "SELECT tableoid::regclass::text FROM outbox_sent_new "
                    "WHERE payload->>'n' = '61'"
                ).fetchone()
                assert landed == ("outbox_sent_unpublished",)
        with Runner(dsn, settings, name) as runner:
            assert runner.verify() == []
            assert runner.status()["state"] == "completed"
        bound = conn.execute(
            "SELECT pg_get_expr(relpartbound, oid) FROM pg_class "
            "WHERE relname = 'outbox_sent_unpublished'"
        ).fetchone()
    assert bound == ("FOR VALUES IN (false)",)
