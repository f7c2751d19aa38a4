"""Every example in `--help` runs as written (issue 14: the top-level `plan --pattern hoper
--dsn embedded` failed, because the embedded database has no outbox).

The examples are read from the commands themselves, so a new one is run too — or fails this
test until it is given its place in the story below. They run in a shell, in one database
that `$DATABASE_URL` (and `OUTBOX_MIGRATE_DSN`, for the examples without `--dsn`) names,
in the order an operator would: look, plan, migrate, relay, copy back, generate revisions.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from outbox_migrate_harness.testing.schema import create_flat_outbox

pytestmark = pytest.mark.newest_pg_only

STORY = [
    "config", "wizard --no-pause", "wizard", "plan", "ping", "roles", "run", "status", "verify",
    "next", "relay", "dead-letters", "rollback", "maintain", "copy-back", "reset", "alembic",
]  # fmt: skip
"""Where each example runs, by the words after `outbox-migrate` it starts with."""
NOT_RUN = {
    "demo": "a minute of live load each; test_demo_under_load runs the demo",
    "rehearse": "live load on a scratch copy; tests/e2e/test_rehearse.py runs it",
}
BEFORE = {"copy-back": ("run", "--pattern", "hoper", "--to", "V4")}
"""What the migration needs before a stage's examples make sense (not an example itself)."""


def examples() -> list[str]:
    """`outbox-migrate …` lines of the top-level help and every command's `Example:`, as
    pasted from the help a user reads (continuation lines joined)."""
    from outbox_migrate.cli.app import HELP
    from tests.support.help_examples import example_blocks, pasted, rendered_helps

    found = [
        m.group(1) for m in re.finditer(r"^\s+(outbox-migrate [^#\n]+?)\s*(?:#|$)", HELP, re.M)
    ]
    for _path, text in rendered_helps():
        found += [pasted(lines) for lines in example_blocks(text)]
    return list(dict.fromkeys(example.strip() for example in found))


def stage(example: str) -> int:
    words = example.split()[1:]
    for index, start in reversed(list(enumerate(STORY))):
        if words[: len(start.split())] == start.split():
            return index
    raise AssertionError(f"{example!r} has no place in STORY: add one (or to NOT_RUN)")


def test_every_example_has_a_place() -> None:
    for example in examples():
        if example.split()[1] not in NOT_RUN:
            stage(example)


def test_every_help_example_runs_as_written(dsn: str, tmp_path: Path) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
    parts = psycopg.conninfo.conninfo_to_dict(dsn)
    url = f"postgresql://{parts['user']}@{parts['host']}:{parts['port']}/{parts['dbname']}"
    shim = tmp_path / "bin" / "outbox-migrate"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m outbox_migrate "$@"\n')
    shim.chmod(0o755)
    work = tmp_path / "project"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}
    env |= {
        "PATH": f"{shim.parent}:{Path(sys.executable).parent}:{env.get('PATH', '')}",
        "DATABASE_URL": url,  # a URI, as DATABASE_URL usually is: one shell word
        "OUTBOX_MIGRATE_DSN": url,
        "OUTBOX_MIGRATE_GATE_WINDOW_S": "0.2",
        "COLUMNS": "100",
    }
    subprocess.run(["alembic", "init", "migrations"], cwd=work, env=env, check=True,
                   capture_output=True)  # fmt: skip
    ran: list[str] = []
    done_before: set[str] = set()
    for example in sorted(examples(), key=lambda e: (e.split()[1] in NOT_RUN, stage_or(e))):
        command = example.split()[1]
        if command in NOT_RUN:
            continue
        if command in BEFORE and command not in done_before:
            setup = subprocess.run([sys.executable, "-m", "outbox_migrate", *BEFORE[command]],
                                   cwd=work, env=env, capture_output=True, text=True)  # fmt: skip
            assert setup.returncode == 0, setup.stderr
            done_before.add(command)
        result = _run(example, work, env)
        assert result.returncode == 0, (example, result.stdout[-2000:], result.stderr[-2000:])
        assert "error:" not in result.stderr, (example, result.stderr)
        ran.append(example)
    assert (work / "hoper.sql").stat().st_size > 0
    assert len(ran) >= 20, ran


def stage_or(example: str) -> int:
    return -1 if example.split()[1] in NOT_RUN else stage(example)


def _run(example: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A shell runs the line as written; the bare `wizard` asks, so it gets a terminal and
    the answers a person would type."""
    if example.strip() != "outbox-migrate wizard":
        return subprocess.run(["bash", "-c", example], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=180, stdin=subprocess.DEVNULL)  # fmt: skip
    import pty

    master, slave = pty.openpty()
    try:
        os.write(master, b"n\ny\nn\n")
        return subprocess.run(["bash", "-c", example], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=60, stdin=slave)  # fmt: skip
    finally:
        os.close(master)
        os.close(slave)
