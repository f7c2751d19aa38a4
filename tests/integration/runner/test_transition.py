"""The one step-state transition on a real server: an illegal move changes nothing and
fails loudly; a legal one stamps the row."""

from __future__ import annotations

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox

from outbox_migrate.config import load_settings
from outbox_migrate.runner import Runner
from outbox_migrate.runner.ledger import IllegalTransition, transition

SETTINGS = load_settings({"gate_window_s": 0.05}, environ={})
FIRST = "hop.v2.create-partitioned-table"


def states(conn: psycopg.Connection[tuple[object, ...]]) -> list[tuple[object, ...]]:
    return conn.execute(
        "SELECT step_id, state, last_error FROM outbox_migrate.step ORDER BY 1"
    ).fetchall()


def test_a_done_step_moves_only_by_rolling_back(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        with Runner(dsn, SETTINGS, "hop") as runner:
            runner.run("V2")
        migration = conn.execute("SELECT id FROM outbox_migrate.migration").fetchone()
        assert migration is not None
        before = states(conn)
        for target in ("done", "running", "failed", "pending"):
            with pytest.raises(IllegalTransition, match=f"done -> {target}"):
                transition(conn, int(str(migration[0])), FIRST, target, error="nope")
        with pytest.raises(IllegalTransition, match="unknown step state"):
            transition(conn, int(str(migration[0])), FIRST, "skipped")
        assert states(conn) == before
        transition(conn, int(str(migration[0])), FIRST, "rolled_back")
        row = conn.execute(
            "SELECT state, finished_at IS NOT NULL FROM outbox_migrate.step WHERE step_id = %s",
            (FIRST,),
        ).fetchone()
        assert row == ("rolled_back", True)
