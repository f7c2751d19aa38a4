"""The original-name phases from the command line: `run --to original-name` is a phase the CLI
accepts (before, `--to` refused it as an unknown choice), only with --with-optional; then
`status` and `verify` under the names the outbox has after the rename."""

from __future__ import annotations

import json
import subprocess

import psycopg
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from tests.support.cli import error_line, run_cli


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env={"OUTBOX_MIGRATE_GATE_WINDOW_S": "0.1"})


def test_run_to_original_name_and_status_by_the_new_names(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5, published=True)
    for phase in ("V2", "V3"):
        assert cli("run", "--pattern", "cop", "--to", phase, "--dsn", dsn).returncode == 0
    line = error_line(cli("run", "--pattern", "cop", "--to", "original-name", "--dsn", dsn), 2)
    assert "original-name is an optional phase: run it with --with-optional" in line
    done = cli("run", "--pattern", "cop", "--to", "original-name", "--with-optional", "--dsn", dsn)
    assert done.returncode == 0, done.stderr
    with psycopg.connect(dsn) as conn:
        assert conn.execute(
            "SELECT (SELECT relkind::text FROM pg_class WHERE oid = 'outbox'::regclass), "
            "(SELECT relkind::text FROM pg_class WHERE oid = 'outbox_new'::regclass)"
        ).fetchone() == ("p", "v")
    names = ("--table", "outbox_retired", "--partitioned-table", "outbox")
    status = cli("status", *names, "--format", "json", "--dsn", dsn)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["phase"] == "original-name"
    verify = cli("verify", *names, "--dsn", dsn)
    assert verify.returncode == 0, verify.stderr
    assert "phase original-name holds" in verify.stdout
    # The relay command the step's note gives starts and drains (the playbooks said
    # `--partitioned-table outbox` alone, which exits 2: --table still named outbox too).
    note = json.loads(cli("plan", "--pattern", "cop", "--with-optional", "--format", "json").stdout)
    (step,) = [s for p in note["phases"] if p["name"] == "original-name" for s in p["steps"]]
    advice = next(n for n in step["notes"] if "start new relays with" in n)
    flags = advice.split("start new relays with ")[1].split(" (")[0].split()
    assert flags == ["--partitioned-table", "outbox", "--table", "outbox_retired"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (payload) VALUES ('{}')")
    relay = cli("relay", *flags, "--sink", "stdout", "--until-empty", "--no-listen", "--dsn", dsn)
    assert relay.returncode == 0, relay.stderr
    assert len(relay.stdout.splitlines()) == 1
