"""Regenerate the derived files the tests diff: `plan` output per pattern and format
(`tests/golden/plan/`) and the playbooks (`playbooks/*.md`).

Run `python -m tests.golden.regenerate` (or `nox -s regenerate`) after changing the catalog
or a renderer, then review the diff like any other change: it is what operators will read.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from outbox_migrate.patterns import PATTERN_NAMES
from outbox_migrate.playbook import render_playbook

ROOT = Path(__file__).resolve().parents[2]
PLAN_DIR = ROOT / "tests" / "golden" / "plan"
PLAYBOOK_DIR = ROOT / "playbooks"
FORMATS = {"table": "txt", "markdown": "md", "json": "json", "sql": "sql"}
TERMINAL_COLUMNS = "120"

CUSTOM_ARGS = (
    "--schema", "billing", "--table", "Events", "--partitioned-table", "events_p",
    "--unpublished-partition", "events_todo", "--published-partition", "events_done",
    "--with-optional",
)  # fmt: skip
"""One case with non-default names: quoting, qualified names and optional steps."""


def cases() -> dict[str, tuple[str, ...]]:
    """Golden file name → `plan` arguments."""
    found: dict[str, tuple[str, ...]] = {}
    for pattern in PATTERN_NAMES:
        for fmt, suffix in FORMATS.items():
            found[f"{pattern}.{suffix}"] = ("--pattern", pattern, "--format", fmt)
    found["hopia-custom-names.sql"] = ("--pattern", "hopia", "--format", "sql", *CUSTOM_ARGS)
    found["hopia-custom-names.md"] = ("--pattern", "hopia", "--format", "markdown", *CUSTOM_ARGS)
    return found


def clean_env() -> dict[str, str]:
    """The CLI's environment with nothing that changes its output: no OUTBOX_MIGRATE_* or
    libpq PG* variables (they would point `plan` at a database), no colour forcing, a fixed
    terminal width."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OUTBOX_MIGRATE_", "PG"))
        and k not in {"FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "LINES"}
    }
    env["COLUMNS"] = TERMINAL_COLUMNS
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONIOENCODING"] = "utf-8"
    return env


@contextlib.contextmanager
def clean_process() -> Iterator[None]:
    """Run the CLI in this process as if freshly started with `clean_env()` in an empty
    directory: environment swapped, no config file, rich's cached consoles recreated (they
    read COLUMNS when created)."""
    from outbox_migrate.cli import console

    saved_env, saved_cwd = dict(os.environ), Path.cwd()
    with tempfile.TemporaryDirectory() as empty:
        os.environ.clear()
        os.environ.update(clean_env())
        os.chdir(empty)
        console.out.cache_clear()
        console.err.cache_clear()
        try:
            yield
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            console.out.cache_clear()
            console.err.cache_clear()


def run_plan(args: tuple[str, ...]) -> str:
    """`outbox-migrate plan ARGS` through the console script's entry point, in-process."""
    from outbox_migrate.cli.app import main as cli_main

    stdout, stderr = io.StringIO(), io.StringIO()
    with clean_process(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            cli_main(["plan", *args])
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise RuntimeError(f"plan {' '.join(args)} failed: {stderr.getvalue()}") from None
    return stdout.getvalue()


def run_plan_subprocess(args: tuple[str, ...]) -> str:
    """The same, as a user runs it: a fresh `python -m outbox_migrate` process."""
    with tempfile.TemporaryDirectory() as empty:
        result = subprocess.run(
            [sys.executable, "-m", "outbox_migrate", "plan", *args],
            capture_output=True,
            text=True,
            encoding="utf-8",
            env=clean_env(),
            cwd=empty,
            timeout=120,
            check=False,
        )
    if result.returncode != 0:
        raise RuntimeError(f"plan {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def render_all() -> dict[str, str]:
    """Every golden file's fresh content."""
    return {name: run_plan(args) for name, args in cases().items()}


def playbooks() -> dict[Path, str]:
    return {PLAYBOOK_DIR / f"{name}.md": render_playbook(name) for name in PATTERN_NAMES}


def main() -> None:
    PLAN_DIR.mkdir(parents=True, exist_ok=True)
    for stale in PLAN_DIR.iterdir():
        stale.unlink()
    for name, text in render_all().items():
        (PLAN_DIR / name).write_text(text, encoding="utf-8")
    PLAYBOOK_DIR.mkdir(exist_ok=True)
    for path, text in playbooks().items():
        path.write_text(text, encoding="utf-8")
    sys.stdout.write(f"wrote {len(cases())} plan golden files and {len(PATTERN_NAMES)} playbooks\n")


if __name__ == "__main__":
    main()
