"""`outbox-migrate wizard` as a user runs it: flags, JSON, interactive answers on stdin, bad
input, and measurements of a live outbox with --dsn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.wizard import QUESTIONS
from tests.support.cli import error_line, run_cli

FLAGS = {
    "cop": ["--pause", "--no-keep-old-rows"],
    "copra": ["--pause", "--keep-old-rows"],
    "hop": ["--no-pause", "--no-keep-old-rows"],
    "hoper": ["--no-pause", "--keep-old-rows", "--no-immediate-access"],
    "hopia": ["--no-pause", "--keep-old-rows", "--immediate-access"],
}


def wizard(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli("wizard", *args, stdin=stdin, env={"COLUMNS": "200"}, timeout=60)


def one_line_usage_error(result: subprocess.CompletedProcess[str]) -> str:
    return error_line(result, 2, only=True)


@pytest.mark.parametrize("pattern", list(FLAGS))
def test_flags_and_json(pattern: str) -> None:
    result = wizard(*FLAGS[pattern], "--format", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["pattern"] == pattern
    assert isinstance(doc["reasons"], list) and len(doc["reasons"]) == 2
    assert set(doc["rejected"]) == set(FLAGS) - {pattern}
    assert "measurements" not in doc


def test_text_output_explains_the_choice_and_the_rejections() -> None:
    result = wizard(*FLAGS["hoper"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Recommended pattern: HOPER" in out
    assert "Not chosen:" in out
    for other in ("COP", "COPRA", "HOP", "HOPIA"):
        assert f"  - {other}: " in out
    assert "Next: outbox-migrate plan --pattern hoper" in out


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ((), "--pause"),
        (("--pause",), "--keep-old-rows"),
        (("--no-pause", "--keep-old-rows"), "--immediate-access"),
        (("--no-pause", "--keep-old-rows", "--format", "json"), "--immediate-access"),
    ],
)
def test_missing_answer_without_a_terminal_is_one_line_exit_2(
    args: tuple[str, ...], flag: str
) -> None:
    line = one_line_usage_error(wizard(*args))
    assert flag in line and f"--no-{flag[2:]}" in line


def test_json_never_prompts_and_interactive_json_is_refused() -> None:
    assert "--pause" in one_line_usage_error(wizard("--format", "json", stdin="y\ny\n"))
    line = one_line_usage_error(wizard("--interactive", "--format", "json", stdin="y\ny\n"))
    assert "--format text" in line


def test_interactive_answers_from_stdin() -> None:
    result = wizard("--interactive", stdin="n\ny\ny\n")
    assert result.returncode == 0, result.stderr
    for question in QUESTIONS.values():
        assert question in result.stdout
    assert "Recommended pattern: HOPIA" in result.stdout


def test_interactive_asks_only_what_the_flowchart_needs() -> None:
    result = wizard("--interactive", stdin="y\nn\n")
    assert result.returncode == 0, result.stderr
    assert QUESTIONS["immediate_access"] not in result.stdout
    assert "Recommended pattern: COP" in result.stdout


def test_interactive_flags_fill_in_and_bad_answers_are_asked_again() -> None:
    result = wizard("--interactive", "--no-pause", stdin="maybe\ny\nn\n")
    assert result.returncode == 0, result.stderr
    assert QUESTIONS["pause"] not in result.stdout  # answered by the flag
    assert "Please enter Y or N" in result.stdout
    assert "Recommended pattern: HOPER" in result.stdout


def test_interactive_stdin_ending_early_is_exit_2() -> None:
    line = one_line_usage_error(wizard("--interactive", stdin="n\n"))
    assert "stdin ended" in line and "--keep-old-rows" in line


@pytest.mark.newest_pg_only
def test_dsn_measures_the_live_outbox(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5_000, published=True)
        insert_rows(conn, "outbox", 37)
        conn.execute("ANALYZE outbox")
        conn.execute("CREATE PUBLICATION outbox_cdc FOR TABLE outbox")
    stop = threading.Event()

    def application() -> None:
        """Keep inserting while the wizard samples, so the insert rate is not zero."""
        with psycopg.connect(dsn, autocommit=True) as app:
            while not stop.is_set():
                insert_rows(app, "outbox", 5)
                time.sleep(0.05)

    writer = threading.Thread(target=application)
    writer.start()
    try:
        result = wizard(*FLAGS["copra"], "--dsn", dsn, "--format", "json")
    finally:
        stop.set()
        writer.join(10)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["pattern"] == "copra"
    measured = doc["measurements"]
    assert measured["row_estimate"] >= 5_000
    assert measured["total_bytes"] > 0 and measured["heap_bytes"] > 0
    assert measured["unpublished"] >= 37
    assert measured["inserts_per_s"] > 0
    assert measured["publications"] == ["outbox_cdc"]
    assert measured["blockers"] == []
    notes = " ".join(doc["notes"])
    assert "unpublished" in notes and "MiB" in notes and "inserts/s" in notes
    assert "messages waiting" in notes  # COPRA pauses publication
    assert "VALIDATE" in notes
    assert "publications outbox_cdc include the outbox" in notes


@pytest.mark.newest_pg_only
def test_dsn_reports_blockers_in_the_notes(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        conn.execute("CREATE TABLE receipts (outbox_id int8 REFERENCES outbox (id))")
    result = wizard(*FLAGS["hop"], "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert "Recommended pattern: HOP" in result.stdout
    assert 'blocker: foreign key "receipts_outbox_id_fkey" on receipts references outbox' in (
        result.stdout
    )


def test_a_terminal_on_stdin_is_asked_without_flags() -> None:
    """The default: with a terminal on stdin (and text output) the wizard asks by itself."""
    import pty

    primary, secondary = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}
    try:
        os.write(primary, b"n\nn\n")
        result = subprocess.run(
            [sys.executable, "-m", "outbox_migrate", "wizard"],
            stdin=secondary,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    finally:
        os.close(primary)
        os.close(secondary)
    assert result.returncode == 0, result.stderr
    assert QUESTIONS["pause"] in result.stdout
    assert "Recommended pattern: HOP" in result.stdout


@pytest.mark.newest_pg_only
def test_dsn_without_the_table_is_one_line_exit_2(dsn: str) -> None:
    line = one_line_usage_error(wizard(*FLAGS["cop"], "--dsn", dsn, "--table", "events"))
    assert "table events does not exist in database" in line


def test_a_table_never_analyzed_is_not_reported_empty(dsn: str) -> None:
    """`reltuples` is -1 until the first VACUUM or ANALYZE: the wizard said `outbox: ~0 rows,
    … 2,000 unpublished` for a fresh 3,000-row table in schema `app`. Now the live-row
    counter stands in, the unpublished count bounds it, and the line names the table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        conn.execute(
            "CREATE TABLE app.event_outbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            "payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), "
            "published_at timestamptz) WITH (autovacuum_enabled = false)"
        )
        conn.execute(
            "INSERT INTO app.event_outbox (payload, published_at) SELECT '{}', "
            "CASE WHEN g % 3 = 0 THEN now() END FROM generate_series(1, 3000) g"
        )
        never = "SELECT reltuples FROM pg_class WHERE oid = 'app.event_outbox'::regclass"
        assert conn.execute(never).fetchone() == (-1,)
    result = wizard(*FLAGS["copra"], "--dsn", dsn, "--schema", "app", "--table", "event_outbox",
                    "--format", "json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["measurements"]["unpublished"] == 2000
    assert doc["measurements"]["row_estimate"] >= 2000
    assert any(note.startswith("app.event_outbox: ~") for note in doc["notes"]), doc["notes"]
