"""The `relay` command as a user runs it, and the application-side insert helpers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psycopg
import pytest
import sqlalchemy as sa
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.relay.writer import (
    WritePhase,
    insert_message,
    insert_message_sa,
    outbox_tables,
    target_table,
)
from tests.support.cli_process import until_counted

from .conftest import PARTITIONED_START, SPEC, ids_in


def relay_cli(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "relay", *args],
        capture_output=True, text=True, timeout=120, **kwargs,
    )  # fmt: skip


def test_a_sigterm_while_the_relay_starts_is_its_normal_stop(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    """SIGTERM while `relay --install-notify` waits for its lock on the outbox (a session of
    the test holds it): the relay finishes installing the trigger, starts nothing and exits
    0, as docs/cli.md says of a service's stop — no error line, nothing published. Fails
    before: the relay's own handler came only after the trigger was installed, so the
    signal raised `Terminated` there (exit 143, "terminated during relay")."""
    insert_rows(partitioned, "outbox_new", 5, spec=SPEC)
    with psycopg.connect(dsn) as blocker:
        blocker.execute("LOCK TABLE outbox_new IN ACCESS EXCLUSIVE MODE")
        process = subprocess.Popen(
            [sys.executable, "-m", "outbox_migrate", "relay", "--dsn", dsn, "--sink", "stdout",
             "--install-notify"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            until_counted(
                partitioned,
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND application_name LIKE '%relay%' AND datname = current_database()",
                timeout=30,
                what="the relay waiting for its lock",
            )
            process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            blocker.rollback()  # within the install's 2-s lock timeout
            out, err = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, err
    assert "error" not in err and out == ""
    assert len(ids_in(partitioned, "outbox_unpublished")) == 5


def test_cli_stdout_until_empty_prints_one_json_object_per_message(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    insert_rows(partitioned, "outbox_new", 250, spec=SPEC)
    result = relay_cli("--sink", "stdout", "--until-empty", "--dsn", dsn, "--batch-size", "100")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    objects = [json.loads(line) for line in lines]
    assert [o["id"] for o in objects] == list(range(PARTITIONED_START, PARTITIONED_START + 250))
    assert objects[0]["payload"]["n"] == 1
    assert objects[0]["event_type"] == "event"
    assert ids_in(partitioned, "outbox_unpublished") == []


def test_cli_flat_mode_with_workers(dsn: str, flat: psycopg.Connection) -> None:
    insert_rows(flat, "outbox", 500, spec=SPEC)
    result = relay_cli(
        "--sink", "stdout", "--mode", "flat", "--until-empty", "--dsn", dsn, "--workers", "3",
        "--batch-size", "40",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    ids = sorted(json.loads(line)["id"] for line in result.stdout.splitlines())
    assert ids == list(range(1, 501))


def test_cli_rejects_unknown_mode_with_usage_exit(dsn: str) -> None:
    result = relay_cli("--sink", "stdout", "--mode", "sideways", "--dsn", dsn)
    assert result.returncode == 2
    assert "'--mode'" in result.stderr and "'sideways' is not one of" in result.stderr


def test_cli_missing_table_is_one_line_naming_the_options(dsn: str) -> None:
    result = relay_cli("--sink", "stdout", "--until-empty", "--dsn", dsn)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "outbox-migrate: error: table public.outbox_new does not exist; "
        "name the outbox with --schema and --partitioned-table"
    ]
    flat = relay_cli("--sink", "stdout", "--until-empty", "--dsn", dsn, "--mode", "flat",
                     "--table", "nope")  # fmt: skip
    assert flat.returncode == 2
    assert flat.stderr.strip().splitlines() == [
        "outbox-migrate: error: table public.nope does not exist; "
        "name the outbox with --schema and --table"
    ]


def test_cli_unknown_sink_is_a_usage_error(dsn: str, partitioned: psycopg.Connection) -> None:
    result = relay_cli("--sink", "carrier-pigeon", "--until-empty", "--dsn", dsn)
    assert result.returncode == 2
    assert "unknown sink 'carrier-pigeon'" in result.stderr


def test_cli_sink_that_cannot_be_built_fails_cleanly(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    insert_rows(partitioned, "outbox_new", 3, spec=SPEC)
    result = relay_cli("--sink", "http", "--until-empty", "--dsn", dsn)
    assert result.returncode == 2
    assert "outbox-migrate: error: the http sink needs --sink-url" in result.stderr
    assert len(ids_in(partitioned, "outbox_unpublished")) == 3


def test_cli_sigterm_stops_gracefully_and_serves_metrics(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    import urllib.request

    from outbox_migrate_harness.testing.server import free_port

    pytest.importorskip("prometheus_client")
    insert_rows(partitioned, "outbox_new", 40, spec=SPEC)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox_migrate", "relay", "--sink", "stdout", "--dsn", dsn,
         "--metrics-port", str(port), "--poll-interval", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        body = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    body = r.read().decode()
                if "outbox_relay_published_total 40.0" in body:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        assert "outbox_relay_published_total 40.0" in body
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            assert r.status == 200
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert len(out.splitlines()) == 40


def test_insert_message_targets_the_table_of_the_phase(
    dsn: str, partitioned: psycopg.Connection
) -> None:
    create_flat_outbox(partitioned, SPEC)
    assert target_table(SPEC, WritePhase.flat) == "outbox"
    assert target_table(SPEC, WritePhase.partitioned) == "outbox_new"
    with partitioned.transaction():
        old = insert_message(partitioned, {"a": 1}, phase=WritePhase.flat, key="k1")
        new = insert_message(partitioned, '{"b": 2}', phase=WritePhase.partitioned,
                             event_type="OrderCreated")  # fmt: skip
    assert ids_in(partitioned, "outbox") == [old]
    assert ids_in(partitioned, "outbox_unpublished") == [new]
    row = partitioned.execute("SELECT event_type, payload::text FROM outbox_new").fetchone()
    assert row == ("OrderCreated", '{"b": 2}')


def test_insert_rolls_back_with_the_business_transaction(partitioned: psycopg.Connection) -> None:
    with pytest.raises(RuntimeError), partitioned.transaction():
        insert_message(partitioned, {"a": 1}, phase=WritePhase.partitioned)
        raise RuntimeError("business logic failed")
    assert ids_in(partitioned, "outbox_new") == []


def test_sqlalchemy_tables_and_insert(dsn: str, partitioned: psycopg.Connection) -> None:
    create_flat_outbox(partitioned, SPEC)
    engine = sa.create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
    tables = outbox_tables(sa.MetaData(), SPEC)
    listener = psycopg.connect(dsn, autocommit=True)
    listener.execute("LISTEN outbox_migrate_relay")
    try:
        with engine.begin() as connection:
            flat_id = insert_message_sa(connection, tables, {"x": 1}, phase=WritePhase.flat)
            new_id = insert_message_sa(
                connection, tables, {"y": 2}, phase=WritePhase.partitioned, key="order-7"
            )
        notified = [n.payload for n in listener.notifies(timeout=2, stop_after=2)]
    finally:
        listener.close()
        engine.dispose()
    assert ids_in(partitioned, "outbox") == [flat_id]
    assert ids_in(partitioned, "outbox_unpublished") == [new_id]
    assert new_id >= PARTITIONED_START
    assert notified == [str(flat_id), str(new_id)]
    # The Table definitions match the real columns (reflection agrees on names).
    reflector = sa.create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
    try:
        reflected = sa.Table("outbox_new", sa.MetaData(), autoload_with=reflector)
    finally:
        reflector.dispose()
    assert {c.name for c in reflected.columns} == {
        c.name for c in tables[WritePhase.partitioned].columns
    }


SLOW_SINK = """
import sys, time

class Slow:
    def publish(self, batch):
        sys.stdout.write("".join(f"{m.id}\\n" for m in batch))
        sys.stdout.flush()
        time.sleep(0.2)

    def close(self):
        pass

def build(config):
    return Slow()
"""


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_before_the_outbox_is_empty_is_not_a_successful_until_empty(
    dsn: str, partitioned: psycopg.Connection, tmp_path, signum: int, code: int
) -> None:
    """`relay --once` stopped by a signal with rows left exited 0, so `relay --once &&
    next-step` went on with an outbox that was not empty. Now it exits as the signal, one
    line; the batch in flight was finished and marked, the rest left for the next run."""
    (tmp_path / "slow_sink.py").write_text(SLOW_SINK)
    insert_rows(partitioned, "outbox_new", 30, spec=SPEC)
    partitioned.commit()
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox_migrate", "relay", "--dsn", dsn, "--sink",
         "slow_sink:build", "--once", "--no-listen", "--batch-size", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert process.stdout is not None
    process.stdout.readline()  # the first batch is being published
    process.send_signal(signum)
    _out, err = process.communicate(timeout=60)
    assert process.returncode == code, err
    (line,) = err.strip().splitlines()
    assert line.startswith("outbox-migrate: error: ") and "re-run the same command" in line
    assert 0 < len(ids_in(partitioned, "outbox_unpublished")) < 30
