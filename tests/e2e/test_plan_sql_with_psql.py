"""`plan --format sql` applied with psql, one phase at a time, for every pattern and version.

Between phases the test behaves like the application the spec describes (inserting and
publishing where each version does). At the end the layout is checked from the catalog — the
pattern's own invariants — and every row ever written must still be there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox, insert_rows
from outbox_migrate_harness.testing.server import Server

from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns import PATTERN_NAMES, BuildOptions, build_pattern
from outbox_migrate.plan import split_sql_phases
from tests.support.app import act_as, count, publish_all, violations

ATTACHES_OLD = {"copra", "hoper", "hopia"}


def plan_sql(pattern: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_MIGRATE_")}
    env["OUTBOX_MIGRATE_GATE_WINDOW_S"] = "0.2"
    result = subprocess.run(
        [sys.executable, "-m", "outbox_migrate", "plan", "--pattern", pattern, "--format", "sql"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return result.stdout


def psql(server: Server, dsn: str, sql_text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [server.tool("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", "-"],
        input=sql_text,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


@pytest.mark.parametrize("pattern", PATTERN_NAMES)
def test_plan_sql_migrates_a_live_outbox(pattern: str, pg_server: Server, dsn: str) -> None:
    phases = split_sql_phases(plan_sql(pattern))
    built = build_pattern(pattern, OutboxSpec(), BuildOptions(sample_window_s=0.2))
    assert list(phases) == built.phase_names()
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 300, published=True)
        insert_rows(conn, "outbox", 20)  # unpublished when the migration starts
        written = 320
        for phase in built.phases:
            if phase.name != built.phases[0].name:
                # The previous version finished its rollout: it drained what it publishes from.
                previous = built.phases[built.phases.index(phase) - 1]
                if previous.app.publishes_from.value in ("old", "old-then-new"):
                    publish_all(conn, "outbox")
            result = psql(pg_server, dsn, phases[phase.name])
            assert result.returncode == 0, f"{phase.name}: {result.stderr}"
            act_as(conn, phase)
            written += 7
        publish_all(conn, "outbox_new")

        held = built.invariants(built.phases[-1].name)
        assert violations(conn, [c for _, c in held]) == []
        default = "outbox" if pattern in ATTACHES_OLD else "outbox_published"
        bound = conn.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'outbox_new'::regclass "
            "ORDER BY 1"
        ).fetchall()
        assert sorted(bound) == sorted(
            [(default, "DEFAULT"), ("outbox_unpublished", "FOR VALUES IN (NULL)")]
        )
        leftovers = conn.execute(
            "SELECT count(*) FROM pg_constraint WHERE conname = 'outbox_published_check'"
        ).fetchone()
        assert leftovers == (0,)
        # Only the relay's wake-up trigger and the unpublished partition's DELETE guard stay
        # (by design); no migration trigger (HOPIA's copy trigger, the gates') is left behind.
        assert sorted(conn.execute(
            "SELECT tgrelid::regclass::text, tgname FROM pg_trigger WHERE NOT tgisinternal"
        ).fetchall()) == [
            ("outbox_new", "outbox_unpublished_guard"),
            ("outbox_new", "relay_notify"),
            ("outbox_unpublished", "outbox_unpublished_guard"),
        ]  # fmt: skip
        identity = conn.execute(
            "SELECT a.attrelid::regclass::text FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
            "WHERE a.attidentity <> '' AND NOT c.relispartition "
            "AND a.attrelid IN ('outbox'::regclass, 'outbox_new'::regclass)"
        ).fetchall()
        expected_identity = (
            [("outbox_new",)] if pattern in ATTACHES_OLD else [("outbox",), ("outbox_new",)]
        )
        assert sorted(identity) == sorted(expected_identity)
        if pattern in ATTACHES_OLD:
            assert count(conn, "outbox_new") == written
        else:
            assert count(conn, "outbox") + count(conn, "outbox_new") == written
        duplicates = conn.execute(
            "SELECT count(*) FROM (SELECT id FROM outbox_new GROUP BY id HAVING count(*) > 1) d"
        ).fetchone()
        assert duplicates == (0,)


def test_offline_precondition_aborts_the_phase_and_leaves_nothing(
    pg_server: Server, dsn: str
) -> None:
    """V3 applied while the old table still has unpublished rows: the gate's assertion raises
    its message, psql stops, and no V3 change is in the database."""
    phases = split_sql_phases(plan_sql("copra"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        insert_rows(conn, "outbox", 5)
        assert psql(pg_server, dsn, phases["V2"]).returncode == 0
        result = psql(pg_server, dsn, phases["V3"])
        assert result.returncode != 0
        assert "5 unpublished rows remain in" in result.stderr
        identity = conn.execute(
            "SELECT attidentity FROM pg_attribute WHERE attrelid = 'outbox'::regclass AND attname = 'id'"
        ).fetchone()
        assert identity == ("a",)  # DROP IDENTITY (the next step) did not run
        assert conn.execute(
            "SELECT count(*) FROM pg_constraint WHERE conname = 'outbox_published_check'"
        ).fetchone() == (0,)
