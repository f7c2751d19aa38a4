"""A signal at any instant of a command's life ends it with its exit code and one line, never
a traceback — including the first few hundred milliseconds, while typer, rich and psycopg
are still being imported (the handlers used to be installed only after them)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.support.cli import ERROR_PREFIX

INSTANTS_MS = list(range(50, 650, 50))
"""From 50 ms: the interpreter's own first ~20 ms (site, runpy) run before any of the
program's code and keep Python's defaults (docs/cli.md says so)."""
EXPECTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


@pytest.fixture(scope="module")
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers: the command waits on its
    connection for as long as the test needs, with no database involved."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        yield listener.getsockname()[1]


def _start(port: int) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}
    dsn = f"host=127.0.0.1 port={port} dbname=none user=nobody connect_timeout=30"
    return subprocess.Popen(
        [sys.executable, "-m", "outbox_migrate", "ping", "--dsn", dsn],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_at_any_instant_exits_with_its_code_and_no_traceback(
    silent_server: int, signum: signal.Signals
) -> None:
    for instant_ms in INSTANTS_MS:
        proc = _start(silent_server)
        time.sleep(instant_ms / 1000)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
        # CPython itself ends with SIGINT (the shell's 130) when a KeyboardInterrupt once
        # escaped an eval()/exec() during the run (e.g. a dataclass being built at import),
        # even though the program caught it and wrote its line.
        assert proc.returncode in (EXPECTED[signum], -signum), (instant_ms, proc.returncode, err)
        assert "Traceback" not in err, (instant_ms, err)
        if proc.returncode > 0:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), (instant_ms, err)
        assert out == "", (instant_ms, out)
