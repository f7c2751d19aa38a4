"""`outbox-migrate plan` as a user runs it: against a live database (concrete values, warnings)
and with bad input (one line on stderr naming the problem, exit code 2, no traceback)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows

from outbox_migrate.advisory.lost_semantics import LAYOUT_WARNINGS
from tests.support.cli import error_line, run_cli


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("plan", *args, timeout=60)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    line = error_line(result, 2, only=True)
    assert result.stdout == ""
    return line


def test_unknown_pattern() -> None:
    line = one_line_error(plan("--pattern", "hopla"))
    assert "'hopla'" in line and "cop" in line and "hopia" in line


def test_unknown_format() -> None:
    line = one_line_error(plan("--pattern", "hop", "--format", "yaml"))
    assert "'yaml'" in line and "--format" in line


@pytest.mark.newest_pg_only
def test_database_without_the_table(dsn: str) -> None:
    line = one_line_error(plan("--pattern", "hop", "--dsn", dsn))
    assert "table outbox does not exist in database" in line
    line = one_line_error(plan("--pattern", "hop", "--dsn", dsn, "--schema", "app"))
    assert "table app.outbox does not exist" in line


@pytest.mark.newest_pg_only
@pytest.mark.parametrize(
    ("ddl", "named"),
    [
        (
            "CREATE TABLE outbox (id uuid PRIMARY KEY, payload json NOT NULL, "
            "published_at timestamptz)",
            'outbox.id is uuid: the application supplies the ids: set id_kind = "application"',
        ),
        (
            "CREATE TABLE outbox (id smallserial PRIMARY KEY, payload json NOT NULL, "
            "published_at timestamptz)",
            "outbox.id is smallint: widen it first",
        ),
        (
            "CREATE TABLE outbox (id int8 GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
            "payload json NOT NULL, published_at text)",
            # a text column may be a status marker, but this one names no unpublished value
            "outbox.published_at is a text flag with no constant DEFAULT",
        ),
        (
            "CREATE TABLE outbox (id int8 PRIMARY KEY, payload json NOT NULL, "
            "published_at timestamptz)",
            "outbox.id is bigint with neither an identity nor a sequence default",
        ),
    ],
    ids=["uuid-id", "smallint-id", "text-published-at", "no-generator"],
)
def test_wrong_column_types(dsn: str, ddl: str, named: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ddl)
    result = plan("--pattern", "copra", "--dsn", dsn)
    # Every blocker is listed (a uuid id also loses its primary key's uniqueness): the one
    # this table is about is among them, and the last line counts them.
    assert result.returncode == 2 and result.stdout == "", result
    assert named in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("outbox-migrate: error: ")


@pytest.mark.newest_pg_only
def test_foreign_key_into_the_outbox(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        conn.execute("CREATE TABLE receipts (outbox_id int8 REFERENCES outbox (id))")
    line = one_line_error(plan("--pattern", "hoper", "--dsn", dsn))
    assert 'foreign key "receipts_outbox_id_fkey" on receipts references outbox' in line
    assert "drop it or point it elsewhere" in line
    as_json = plan("--pattern", "hoper", "--dsn", dsn, "--format", "json")
    assert error_line(as_json, 2, only=True) == line  # stderr as without --format json
    (blocker,) = json.loads(as_json.stdout)["blockers"]
    assert blocker["code"] == "fk-into-outbox"


def live_outbox(dsn: str, *, publication: bool = True) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 2_000, published=True)
        insert_rows(conn, "outbox", 25)
        conn.execute("ANALYZE outbox")
        if publication:
            conn.execute("CREATE PUBLICATION outbox_cdc FOR TABLE outbox")


@pytest.mark.newest_pg_only
def test_dsn_gives_concrete_values_in_every_format(dsn: str) -> None:
    live_outbox(dsn)
    doc = json.loads(plan("--pattern", "hoper", "--dsn", dsn, "--format", "json").stdout)
    facts = doc["facts"]
    assert facts["table"] == "public.outbox"
    assert facts["max_id"] == 2_025 and facts["sequence_last_value"] == 2_025
    assert facts["identity_start"] == 1_002_025
    assert facts["unpublished"] == 25 and facts["row_estimate"] == 2_025
    assert facts["total_bytes"] > 0 and facts["estimated_validate_s"] >= 0
    assert facts["publications"] == ["outbox_cdc"]
    assert facts["blockers"] == []
    assert [w["code"] for w in facts["warnings"]] == ["cdc-publication", *LAYOUT_WARNINGS]
    assert [p["name"] for p in doc["phases"]] == ["V1", "V2", "V3", "V4", "copy-back"]

    markdown = plan("--pattern", "hoper", "--dsn", dsn, "--format", "markdown").stdout
    assert "## Your outbox" in markdown
    assert "~2,025 rows" in markdown and "25 unpublished" in markdown
    assert "max id 2025, new identity starts at 1,002,025" in markdown
    assert "- Warning: publication outbox_cdc (FOR TABLE) includes outbox" in markdown
    assert "Add outbox_unpublished to publication(s) outbox_cdc" in markdown

    table = plan("--pattern", "hoper", "--dsn", dsn)
    assert table.returncode == 0, table.stderr
    assert "Your outbox: PostgreSQL" in table.stdout
    assert "~2,025 rows, 25 unpublished, max id 2025, new identity starts at 1,002,025" in (
        table.stdout
    )
    assert "warning: publication outbox_cdc (FOR TABLE) includes outbox" in table.stdout


@pytest.mark.newest_pg_only
def test_dsn_does_not_change_the_steps(dsn: str) -> None:
    """The live values are shown beside the plan; the steps (and their checksums, which the
    runner compares) are the same as without a DSN — unless a publication covers the outbox,
    which adds exactly one step (carrying the publication to the unpublished partition) and
    the per-phase view of what its consumer sees."""
    live_outbox(dsn, publication=False)
    offline = json.loads(plan("--pattern", "hopia", "--format", "json").stdout)
    online = json.loads(plan("--pattern", "hopia", "--dsn", dsn, "--format", "json").stdout)
    assert online["phases"] == offline["phases"]
    assert offline["facts"] is None and online["facts"] is not None

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE PUBLICATION outbox_cdc FOR TABLE outbox")
    published = json.loads(plan("--pattern", "hopia", "--dsn", dsn, "--format", "json").stdout)

    def steps(doc: dict[str, Any]) -> list[tuple[str, str]]:
        return [(s["id"], s["checksum"]) for p in doc["phases"] for s in p["steps"]]

    added = [s for s in steps(published) if s not in steps(offline)]
    assert [step_id for step_id, _ in added] == ["hopia.v2.publish-unpublished-partition"]
    assert [s for s in steps(published) if s not in added] == steps(offline)


@pytest.mark.newest_pg_only
def test_rollback_of_drop_identity_restores_by_default(dsn: str) -> None:
    """An outbox whose id is GENERATED BY DEFAULT gets that back if DROP IDENTITY is reversed
    (re-adding it as ALWAYS would reject the explicit ids such an application may insert)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE outbox (id int8 GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, "
            "payload json NOT NULL, published_at timestamptz)"
        )

    def reverse_of_drop_identity(*args: str) -> str:
        doc = json.loads(plan("--pattern", "copra", "--format", "json", *args).stdout)
        step = next(s for p in doc["phases"] for s in p["steps"] if s["kind"] == "drop-identity")
        return step["reverse_sql"][0]

    assert reverse_of_drop_identity("--dsn", dsn).endswith("ADD GENERATED BY DEFAULT AS IDENTITY")
    assert reverse_of_drop_identity().endswith("ADD GENERATED ALWAYS AS IDENTITY")
