"""Running `python -m outbox_migrate` as a user would, and checking its one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

ERROR_PREFIX = "outbox-migrate: error: "


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess, with our and libpq's variables scrubbed from the environment
    (so the developer's shell cannot change what a test sees) plus `env`."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}
    full["COLUMNS"] = "160"
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "outbox_migrate", *args],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
        check=False,
    )


def error_line(
    result: subprocess.CompletedProcess[str], code: int = 2, *secrets: str, only: bool = False
) -> str:
    """The error line (the last stderr line), after checking the exit code, that no
    traceback and no secret was printed, and with `only` that it is the only line."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    if only:
        assert len(lines) == 1, result.stderr
    for secret in secrets:
        assert secret not in result.stderr
        assert secret not in result.stdout
    assert lines[-1].startswith(ERROR_PREFIX), result.stderr
    return lines[-1]
