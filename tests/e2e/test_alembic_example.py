"""The repository's example Alembic project (alembic/), as CI runs it.

Online: `alembic upgrade <phase end>` one phase at a time against a real server, the
application simulated between phases. Offline: `alembic upgrade A:B --sql` per phase, applied
with psql in another database. Both end with the same schema. The example's revisions are
also checked to be exactly what `outbox-migrate alembic generate` writes today.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from alembic.config import main as alembic_main
from outbox_migrate_harness.testing.schema import insert_rows
from outbox_migrate_harness.testing.server import Server

from outbox_migrate.alembic_ext.generate import generate
from outbox_migrate.config import OutboxSpec, load_settings
from outbox_migrate.patterns import BuildOptions, build_pattern
from outbox_migrate.runner import Runner
from tests.support.alembic_project import (
    GATE_ENV,
    other_dsn,  # noqa: F401 - fixture
    psql,
    schema_dump,
    sqlalchemy_url,
    version_of,
)
from tests.support.app import act_as, count, publish_all

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "alembic"
INI = EXAMPLE / "alembic.ini"
TARGETS = {
    "V2": "0002_hoper_v2_10",
    "V3": "0002_hoper_v3_01",
    "V4": "0002_hoper_v4_07",
    "copy-back": "0002_hoper_copy_back_02",
}
PATTERN = build_pattern("hoper", OutboxSpec(), BuildOptions(sample_window_s=0.1))


def alembic_process(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`alembic -c alembic/alembic.ini …` in a shell, as CI runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_MIGRATE_")}
    env.update(GATE_ENV)
    env["DATABASE_URL"] = sqlalchemy_url(dsn)
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(INI), *args],
        capture_output=True, text=True, env=env, cwd=ROOT, check=False, timeout=300,
    )  # fmt: skip


def alembic(monkeypatch: pytest.MonkeyPatch, dsn: str, *args: str) -> str:
    """The same command line in this process (Alembic's own `main`), stdout returned: a
    Python start per call would dominate the test's time."""
    for key, value in GATE_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DATABASE_URL", sqlalchemy_url(dsn))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        alembic_main(["-c", str(INI), "-q", *args])
    return out.getvalue()


def phases() -> list[tuple[str, str, str]]:
    """(phase, from revision, to revision) for every phase with steps."""
    previous = "0001"
    found = []
    for phase in PATTERN.phases[1:]:
        found.append((phase.name, previous, TARGETS[phase.name]))
        previous = TARGETS[phase.name]
    return found


def drain_previous(conn: psycopg.Connection, phase: str) -> None:
    index = PATTERN.phase_names().index(phase)
    if PATTERN.phases[index - 1].app.publishes_from.value in ("old", "old-then-new"):
        publish_all(conn, "outbox")


def test_example_online_phase_by_phase_and_offline_with_psql(
    pg_server: Server,
    dsn: str,
    other_dsn: str,  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = alembic_process(dsn, "upgrade", "0001")
    assert first.returncode == 0, first.stderr
    with psycopg.connect(dsn, autocommit=True) as conn:
        insert_rows(conn, "outbox", 100, published=True)
        insert_rows(conn, "outbox", 5)
        for phase, _, target in phases():
            if phase == "V3":
                # A straggling V1 instance wrote 3 rows nobody published: the gate refuses
                # V3 in one line, no traceback, a failing exit status; nothing is applied.
                insert_rows(conn, "outbox", 3)
                refused = alembic_process(dsn, "upgrade", target)
                assert refused.returncode != 0
                assert (
                    "hoper.v3.gate-old-table-retired: precondition old-table-drained:outbox "
                    'failed: 3 unpublished rows remain in "public"."outbox"'
                ) in refused.stderr
                assert "Traceback" not in refused.stderr
                assert version_of(conn) == TARGETS["V2"]
            drain_previous(conn, phase)
            alembic(monkeypatch, dsn, "upgrade", target)
            assert version_of(conn) == target
            act_as(conn, PATTERN.phase(phase))
        online_rows = count(conn, "outbox_new")
    with Runner(dsn, load_settings({}, environ={}), "hoper") as runner:
        assert runner.verify() == []
        assert runner.status()["state"] == "completed"

    offline = alembic_process(other_dsn, "upgrade", "0001", "--sql")
    assert offline.returncode == 0, offline.stderr
    assert psql(pg_server, other_dsn, offline.stdout).returncode == 0
    with psycopg.connect(other_dsn, autocommit=True) as conn:
        insert_rows(conn, "outbox", 100, published=True)
        insert_rows(conn, "outbox", 5)
        for phase, start, target in phases():
            if phase == "V3":
                insert_rows(conn, "outbox", 3)  # the same straggler as online
            drain_previous(conn, phase)
            text = alembic(monkeypatch, other_dsn, "upgrade", f"{start}:{target}", "--sql")
            assert "RAISE EXCEPTION 'outbox-migrate: precondition of" in text
            applied = psql(pg_server, other_dsn, text)
            assert applied.returncode == 0, f"{phase}: {applied.stderr}"
            assert version_of(conn) == target
            act_as(conn, PATTERN.phase(phase))
        assert count(conn, "outbox_new") == online_rows
    assert schema_dump(pg_server, other_dsn) == schema_dump(pg_server, dsn)


def _body(path: Path) -> str:
    return re.sub(r"^Create Date: .*$", "", path.read_text(), flags=re.M)


def test_example_revisions_are_what_generate_writes(tmp_path: Path) -> None:
    copy = tmp_path / "alembic"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__", "0002_*"))
    generate("hoper", load_settings({}, environ={}), copy, tag="0002")
    fresh = sorted(p.name for p in (copy / "versions").glob("0002_*.py"))
    shipped = sorted(p.name for p in (EXAMPLE / "versions").glob("0002_*.py"))
    assert fresh == shipped, (
        "regenerate: rm alembic/versions/0002_* && "
        "outbox-migrate alembic generate --pattern hoper --dir alembic --tag 0002"
    )
    for name in fresh:
        assert _body(copy / "versions" / name) == _body(EXAMPLE / "versions" / name), name
