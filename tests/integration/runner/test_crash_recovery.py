"""Crash safety: the runner SIGKILLed before, inside and after every step, then re-run.

One database walks through the whole pattern. For each step the runner is forked three
times with a fault injected (`OUTBOX_MIGRATE_FAULT=<step>@<point>`): before the step's work
(ledger says running, nothing applied), inside its transaction after the DDL (rolled back by
the server), and right after COMMIT (applied, maybe not yet reported). Its backend is
terminated each time. Finally a normal run completes the pattern, and the schema must equal a
clean run's, byte for byte (`pg_dump --schema-only`, ledger schema excluded).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from outbox_migrate_harness.testing.server import Server
from psycopg import sql

from outbox_migrate.config import load_settings
from outbox_migrate.patterns.model import Pattern, TxMode
from outbox_migrate.runner import Runner
from outbox_migrate.runner.apply import FAULT_ENV
from tests.support.app import act_as, publish_all

SETTINGS = load_settings({"gate_window_s": 0.05, "lock_budget_s": 10.0}, environ={})


RELAY_ROLE = "om_crash_relay"
"""A relay's role (UPDATE on the outbox): it gives `grant-dead-letters` work to do, so that
step runs — and is killed — like the others instead of being adopted as already holding."""


def seed(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 300, published=True)
        insert_rows(conn, "outbox", 5)
        conn.execute(
            f"DO $$ BEGIN CREATE ROLE {RELAY_ROLE}; "
            "EXCEPTION WHEN duplicate_object THEN NULL; END $$"
        )
        conn.execute(f"GRANT SELECT, UPDATE ON outbox TO {RELAY_ROLE}")


def before_phase(conn: psycopg.Connection, pattern: Pattern, index: int) -> None:
    """What the application has done by the time phase `index` starts (deterministic)."""
    previous = pattern.phases[index - 1]
    if previous.app.publishes_from.value in ("old", "old-then-new"):
        publish_all(conn, "outbox")


def killed_run(dsn: str, pattern: str, phase: str, fault: str) -> int:
    """Fork a runner with `fault` set; return how it ended (negative: killed by signal)."""
    pid = os.fork()
    if pid == 0:  # child: run and die at the fault (or finish if the point is never reached)
        os.environ[FAULT_ENV] = fault
        code = 0
        try:
            with Runner(dsn, SETTINGS, pattern) as runner:
                runner.run(phase)
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    terminate_runner_backends(dsn)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def terminate_runner_backends(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True, application_name="crash-test") as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name LIKE 'outbox-migrate/%%' AND datname = current_database()"
        )
        for _ in range(100):
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE "
                "'outbox-migrate/%%' AND datname = current_database()"
            ).fetchone()
            if row == (0,):
                return
            time.sleep(0.02)


def schema_dump(server: Server, dsn: str) -> str:
    result = subprocess.run(
        [server.tool("pg_dump"), "--schema-only", "--no-owner", "--exclude-schema=outbox_migrate",
         "-d", dsn],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    # PostgreSQL 17.6+/18 dumps carry a random \restrict key per dump.
    return "\n".join(
        line for line in result.stdout.splitlines()
        if not line.startswith(("\\restrict", "\\unrestrict"))
    )  # fmt: skip


def clean_database(server: Server, dsn: str) -> str:
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    clean = f"{name}_clean"
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE om_template").format(sql.Identifier(clean))
        )
    return server.dsn(clean)


def drive(dsn: str, name: str, *, kill: bool) -> list[str]:
    """Walk the pattern phase by phase; with `kill`, crash around every step first."""
    outcomes: list[str] = []
    pattern = Runner(dsn, SETTINGS, name).pattern
    with psycopg.connect(dsn, autocommit=True) as conn:
        for index, phase in enumerate(pattern.phases[1:], start=1):
            before_phase(conn, pattern, index)
            if kill:
                for step in phase.steps:
                    points = ["before", "after-commit"]
                    if step.tx is TxMode.TRANSACTION:
                        points.insert(1, "after-ddl")
                    for point in points:
                        code = killed_run(dsn, name, phase.name, f"{step.id}@{point}")
                        outcomes.append(f"{step.id}@{point}:{code}")
            with Runner(dsn, SETTINGS, name) as runner:
                result = runner.run(phase.name)
            assert result.phase == phase.name
            act_as(conn, phase)
        with Runner(dsn, SETTINGS, name) as runner:
            assert runner.verify() == []
    return outcomes


@pytest.mark.parametrize("name", ["hoper", "hopia", "copra"])
def test_killed_at_every_point_converges(name: str, pg_server: Server, dsn: str) -> None:
    seed(dsn)
    outcomes = drive(dsn, name, kill=True)
    # Every fault point was actually reached: the runner died by SIGKILL each time.
    assert outcomes and all(o.endswith(f":{-signal.SIGKILL}") for o in outcomes), outcomes
    other = clean_database(pg_server, dsn)
    try:
        seed(other)
        assert drive(other, name, kill=False) == []
        assert schema_dump(pg_server, dsn) == schema_dump(pg_server, other)
    finally:
        with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(psycopg.conninfo.conninfo_to_dict(other)["dbname"])
                )
            )
