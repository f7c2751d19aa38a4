"""The runner's command line under bad input: one line, the right exit code, nothing applied."""

from __future__ import annotations

import json
import subprocess

import psycopg
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from outbox_migrate_harness.testing.server import free_port

from outbox_migrate.config import load_settings
from outbox_migrate.patterns import build_pattern
from outbox_migrate.runner import Runner
from tests.support.cli import error_line, run_cli


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env={"OUTBOX_MIGRATE_GATE_WINDOW_S": "0.1", **(env or {})})


def ledger_states(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT step_id, state FROM outbox_migrate.step").fetchall())


def test_v3_before_v2(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    line = error_line(cli("run", "--pattern", "hop", "--to", "V3", "--dsn", dsn), 2)
    assert "V3 before V2" in line
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('outbox_new')").fetchone() == (None,)


def test_unmet_precondition_applies_nothing(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 12)
    assert cli("run", "--pattern", "copra", "--to", "V2", "--dsn", dsn).returncode == 0
    line = error_line(cli("run", "--pattern", "copra", "--to", "V3", "--dsn", dsn), 5)
    assert "12 unpublished rows remain in" in line and "phase V3 needs 0" in line
    states = ledger_states(dsn)
    assert all(state == "pending" for step, state in states.items() if ".v3." in step)
    with psycopg.connect(dsn) as conn:
        assert conn.execute(
            "SELECT attidentity FROM pg_attribute WHERE attrelid = 'outbox'::regclass "
            "AND attname = 'id'"
        ).fetchone() == ("a",)


def test_old_writer_still_inserting_is_caught(dsn: str) -> None:
    """A V1 instance still inserting into the old table stops the V3 gate."""
    import threading
    import time

    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    assert cli("run", "--pattern", "hop", "--to", "V2", "--dsn", dsn).returncode == 0
    stop = threading.Event()

    def v1_writer() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                insert_rows(conn, "outbox", 1, published=True)
                time.sleep(0.02)

    thread = threading.Thread(target=v1_writer, daemon=True)
    thread.start()
    try:
        result = cli("run", "--pattern", "hop", "--to", "V3", "--dsn", dsn,
                     env={"OUTBOX_MIGRATE_GATE_WINDOW_S": "0.5"})  # fmt: skip
    finally:
        stop.set()
        thread.join(5)
    line = error_line(result, 5)
    assert "is still receiving inserts" in line


def test_second_runner_exits_3_naming_the_holder(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    settings = load_settings({}, environ={})
    with Runner(dsn, settings, "hop") as first:
        first.acquire()
        holder_pid = first.conn.info.backend_pid
        line = error_line(cli("run", "--pattern", "hop", "--to", "V2", "--dsn", dsn), 3)
    assert "another runner is migrating public.outbox" in line
    assert f"pid {holder_pid}" in line and "outbox-migrate/" in line


def test_step_changed_after_it_ran_is_refused(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    assert cli("run", "--pattern", "hop", "--to", "V2", "--dsn", dsn).returncode == 0
    result = cli("run", "--pattern", "hop", "--to", "V3", "--dsn", dsn,
                 env={"OUTBOX_MIGRATE_ID_HEADROOM": "5"})  # fmt: skip
    line = error_line(result, 2)
    assert "hop.v2.create-partitioned-table was applied with definition" in line


def test_other_pattern_active_is_refused(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    assert cli("run", "--pattern", "hop", "--to", "V2", "--dsn", dsn).returncode == 0
    line = error_line(cli("run", "--pattern", "hoper", "--to", "V2", "--dsn", dsn), 2)
    assert "a HOP migration of public.outbox is active" in line


def test_wrong_dsn() -> None:
    dsn = f"postgresql://app:NotShown99@127.0.0.1:{free_port()}/app"
    line = error_line(cli("run", "--pattern", "hop", "--to", "V2", "--dsn", dsn), 2)
    assert "cannot connect" in line and "NotShown99" not in line


def test_status_and_verify_json(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    v2_steps = len(build_pattern("hop").phase("V2").steps)
    run = cli("run", "--pattern", "hop", "--to", "V2", "--dsn", dsn, "--format", "json")
    events = [json.loads(line) for line in run.stdout.splitlines()]
    assert [e["event"] for e in events].count("step_finished") == v2_steps
    assert events[-1]["event"] == "result" and events[-1]["phase"] == "V2"
    status = json.loads(cli("status", "--pattern", "hop", "--dsn", dsn, "--format", "json").stdout)
    assert status["phase"] == "V2" and status["next_phase"] == "V3"
    # V3: its gate and the gate sequence's removal
    assert [s["state"] for s in status["steps"]] == ["done"] * v2_steps + ["pending"] * 2
    verified = cli("verify", "--pattern", "hop", "--dsn", dsn, "--format", "json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["violations"] == []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP INDEX outbox_new_unpublished_id_idx")
    line = error_line(cli("verify", "--pattern", "hop", "--dsn", dsn), 1)
    assert "outbox_new_unpublished_id_idx" in line


def test_reset_needs_confirmation(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    assert cli("run", "--pattern", "hop", "--to", "V2", "--dsn", dsn).returncode == 0
    error_line(cli("reset", "--pattern", "hop", "--dsn", dsn), 2)
    assert cli("rollback", "--pattern", "hop", "--to", "V1", "--dsn", dsn).returncode == 0
    assert cli("reset", "--pattern", "hop", "--dsn", dsn, "--yes").returncode == 0
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT state FROM outbox_migrate.migration").fetchone() == (
            "abandoned",
        )


def test_unknown_table_leaves_no_migration_record(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    line = error_line(
        cli("run", "--pattern", "hop", "--to", "V2", "--dsn", dsn, "--table", "nosuch"), 2
    )
    assert "table public.nosuch does not exist" in line
    with psycopg.connect(dsn) as conn:
        # Refused before anything is written: not even the ledger schema exists.
        assert conn.execute("SELECT to_regnamespace('outbox_migrate')").fetchone() == (None,)


def test_reset_of_an_unknown_table_or_schema_is_bad_input(dsn: str) -> None:
    """`reset --table nosuch --yes` said "no active migration to reset" and exited 0, where
    `status`, `verify` and `run` exit 2 naming the table (docs/cli.md: an unknown table is
    bad input). A recorded migration is still reset whatever its table became."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    assert cli("run", "--pattern", "hop", "--to", "V2", "--dsn", dsn).returncode == 0
    for names, label in (
        (("--table", "nosuch"), "public.nosuch"),
        (("--schema", "nosuchschema"), "nosuchschema.outbox"),
        (("--pattern", "hop", "--table", "nosuch"), "public.nosuch"),
    ):
        line = error_line(cli("reset", "--yes", *names, "--dsn", dsn), 2, only=True)
        assert f"table {label} does not exist" in line, line
    with psycopg.connect(dsn) as conn:  # the table's own record was left alone
        assert conn.execute("SELECT state FROM outbox_migrate.migration").fetchall() == [
            ("active",)
        ]


def test_run_and_rollback_json_are_json_lines_ending_with_the_result(dsn: str) -> None:
    """`rollback --format json` printed one-line step events, then its result as an indented
    document: neither one JSON document nor JSON lines (as `run`'s output is)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    for command in (("run", "--pattern", "hoper", "--to", "V2"), ("rollback", "--to", "V1")):
        done = cli(*command, "--format", "json", "--dsn", dsn)
        assert done.returncode == 0, done.stderr
        lines = [json.loads(line) for line in done.stdout.splitlines()]  # each line parses
        assert lines[-1]["event"] == "result"
    finished = [e["step"] for e in lines if e["event"] == "step_finished"]
    assert lines[-1]["rolled_back"] == finished != []
