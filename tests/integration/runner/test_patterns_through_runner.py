"""Every pattern from V1 to its end through the runner, on every supported version.

After each step the outgoing application version's insert and publish statements must still
work; after each phase's last step, the incoming version's too (before that the incoming
version is not deployed, and its tables may not exist yet). Like pgroll's per-operation
check, this catches a step that silently breaks a running application.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.config import load_settings
from outbox_migrate.patterns import PATTERN_NAMES
from outbox_migrate.patterns.model import Pattern, Step
from outbox_migrate.runner import Runner
from outbox_migrate.runner.events import SilentEvents
from tests.support.app import act_as, count, exercise, publish_all

FAST = {"gate_window_s": 0.1, "lock_budget_s": 10.0}


class AppChecker(SilentEvents):
    def __init__(self, dsn: str, pattern: Pattern) -> None:
        self.dsn = dsn
        self.pattern = pattern
        self.checked: list[str] = []

    def step_finished(self, step: Step, outcome: str, elapsed_s: float) -> None:
        names = self.pattern.phase_names()
        index = names.index(step.phase)
        outgoing = self.pattern.phases[index - 1]
        exercise(self.dsn, outgoing)
        phase = self.pattern.phases[index]
        if step is phase.steps[-1]:
            exercise(self.dsn, phase)
        self.checked.append(step.id)


def settings(**extra: Any) -> Any:
    return load_settings({**FAST, **extra}, environ={})


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_pattern_runs_to_the_end(name: str, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    _run_to_the_end(name, dsn, {})


UUID_OUTBOX = """
    CREATE TABLE outbox (
        id uuid PRIMARY KEY DEFAULT gen_random_uuid(), event_type text NOT NULL,
        message_key text, payload json NOT NULL,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp(), published_at timestamptz);
    CREATE INDEX outbox_pending ON outbox (created_at, id) WHERE published_at IS NULL
"""


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_pattern_runs_to_the_end_with_uuid_ids(name: str, dsn: str) -> None:
    """Every pattern with application ids: the gate sequence comes and goes with the
    pattern's steps (nothing of it is left at the end), no identity step breaks the old
    version's inserts, and COPRA's attach and HOPER's copy-back handle uuids."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(UUID_OUTBOX)
    _run_to_the_end(name, dsn, {"id_kind": "application", "order_column": "created_at"})
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute(
            "SELECT to_regclass('outbox_gate_seq'), to_regprocedure('outbox_gate_tick()'), "
            "(SELECT count(*) FROM pg_trigger WHERE tgname = 'outbox_gate_tick')"
        ).fetchone()
    assert left == (None, None, 0)


def _run_to_the_end(name: str, dsn: str, names: dict[str, str]) -> None:
    def settings(**extra: Any) -> Any:
        return load_settings({**FAST, **names, **extra}, environ={})

    with psycopg.connect(dsn, autocommit=True) as conn:
        insert_rows(conn, "outbox", 500, published=True)
        insert_rows(conn, "outbox", 10)
    written = 510
    probe = Runner(dsn, settings(), name)
    checker = AppChecker(dsn, probe.pattern)
    pattern = probe.pattern
    with psycopg.connect(dsn, autocommit=True) as conn:
        for index, phase in enumerate(pattern.phases[1:], start=1):
            previous = pattern.phases[index - 1]
            if previous.app.publishes_from.value in ("old", "old-then-new"):
                publish_all(conn, "outbox")
            with Runner(dsn, settings(), name, events=checker) as runner:
                result = runner.run(phase.name)
            assert result.phase == phase.name
            act_as(conn, phase)
            written += 7
        with Runner(dsn, settings(), name) as runner:
            assert runner.verify() == []
            status = runner.status()
        assert status["state"] == "completed"
        assert all(s["state"] == "done" for s in status["steps"])
        assert checker.checked == [s.id for s in pattern.steps()]
        if pattern.keep_old_rows:
            assert count(conn, "outbox_new") == written
        else:
            assert count(conn, "outbox") + count(conn, "outbox_new") == written
        ledger = conn.execute(
            "SELECT state, current_phase FROM outbox_migrate.migration"
        ).fetchall()
        assert ledger == [("completed", pattern.phases[-1].name)]


def test_rerun_is_a_no_op(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    with Runner(dsn, settings(), "hop") as runner:
        first = runner.run("V2")
    with Runner(dsn, settings(), "hop") as runner:
        second = runner.run("V2")
    assert len(first.ran) == 9
    # No role but the owner uses the outbox here: nothing to grant, the grants hold already.
    assert first.adopted == ["hop.v2.grant-dead-letters"]
    assert second.ran == [] and second.adopted == [] and len(second.skipped) == 0
