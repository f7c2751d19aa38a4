"""The runner's guards as the table's owner (what docs/runner.md recommends), against sessions
of the application's role, whose `state`, `xact_start` and `backend_start` PostgreSQL hides
from the owner unless it is granted pg_read_all_stats.

Found in the field: `--on-long-tx refuse` silently did not refuse (the guard read a NULL
state and saw no long transaction), and blockers were named with an empty state. A guard
that cannot see now refuses, naming the grant; once granted, it sees and says what it saw.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox

from outbox_migrate.config import load_settings
from outbox_migrate.errors import LockBudgetExceeded, LongTransactionsPresent, RunnerBusy
from outbox_migrate.runner import Runner
from outbox_migrate.runner.session import runner_lock_key
from tests.integration.runner.test_lock_safety import prepare_hoper_v3
from tests.support.roles import DocumentedRoles


def settings() -> Any:
    return load_settings({"gate_window_s": 0.1, "lock_budget_s": 1.0}, environ={})


@pytest.fixture
def at_v3_as_owner(dsn: str, roles: DocumentedRoles) -> DocumentedRoles:
    prepare_hoper_v3(roles.owner_dsn)  # creates the outbox as the owner
    roles.grant("SELECT, INSERT", "outbox", roles.app)
    return roles


@pytest.mark.newest_pg_only
def test_guards_refuse_on_a_session_they_cannot_see_and_name_the_grant(
    at_v3_as_owner: DocumentedRoles,
) -> None:
    roles = at_v3_as_owner
    grant = f"GRANT pg_read_all_stats TO {roles.owner}"
    with psycopg.connect(roles.app_dsn, application_name="report-job") as app:
        app.execute("SELECT count(*) FROM outbox").fetchone()  # idle in transaction
        with (
            Runner(roles.owner_dsn, settings(), "hoper", on_long_tx="refuse") as runner,
            pytest.raises(LongTransactionsPresent, match="cannot tell whether") as refused,
        ):
            runner.run("V4")
        assert f"pid {app.info.backend_pid} (report-job, state hidden from {roles.owner}" in str(
            refused.value
        )
        assert grant in str(refused.value)
        # Waiting instead: the holder it could not take its locks from is named with the grant.
        with (
            Runner(roles.owner_dsn, settings(), "hoper") as runner,
            pytest.raises(LockBudgetExceeded, match="could not take its locks") as exhausted,
        ):
            runner.run("V4")
        assert f"state hidden from {roles.owner}: {grant}" in str(exhausted.value)

        roles.grant_stats(roles.owner)
        with (
            Runner(roles.owner_dsn, settings(), "hoper", on_long_tx="refuse") as runner,
            pytest.raises(LongTransactionsPresent, match="refusing to queue") as seen,
        ):
            runner.run("V4")
        assert f"pid {app.info.backend_pid} (report-job, idle in transaction" in str(seen.value)
        assert "hidden" not in str(seen.value)


@pytest.mark.newest_pg_only
def test_another_runner_of_another_role_is_named_without_what_is_hidden(
    dsn: str, roles: DocumentedRoles
) -> None:
    """The runner lock held by a session of another role: its client address and start are
    hidden from the owner; the refusal names the session and the grant instead of failing."""
    with psycopg.connect(roles.owner_dsn, autocommit=True) as owner:
        create_flat_outbox(owner)
    with psycopg.connect(roles.app_dsn, autocommit=True, application_name="other-runner") as other:
        pid = other.info.backend_pid
        other.execute("SELECT pg_advisory_lock(%s, %s)", runner_lock_key("public.outbox"))
        with (
            Runner(roles.owner_dsn, settings(), "hoper") as runner,
            pytest.raises(RunnerBusy, match="another runner") as busy,
        ):
            runner.run("V2")
    message = str(busy.value)
    assert f"pid {pid} (other-runner, role {roles.app}" in message
    assert f"GRANT pg_read_all_stats TO {roles.owner}" in message


@pytest.mark.newest_pg_only
def test_the_deploy_gates_see_another_roles_sessions(dsn: str, roles: DocumentedRoles) -> None:
    """The V3/V4 gates read only what PostgreSQL shows every role: application_name, the
    database and pg_locks. As the owner, the old version's session of the application's role
    keeps `no-old-app-sessions` shut (a regression guard: a gate moved to a hidden column such
    as backend_type or state would pass here)."""
    from outbox_migrate.patterns import conditions

    gate = conditions.no_old_app_sessions("orders-v1%", "V3")
    with (
        psycopg.connect(roles.app_dsn, autocommit=True, application_name="orders-v1/7") as app,
        psycopg.connect(roles.owner_dsn, autocommit=True) as owner,
    ):
        rows = owner.execute(gate.query).fetchall()
        assert len(rows) == 1 and f"pids {app.info.backend_pid}" in rows[0][0]
