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
from pathlib import Path

import pytest

from tests.support.cli import ERROR_PREFIX

INSTANTS_MS = list(range(0, 650, 50))
"""From the moment the program's own code has started (its handlers in place, seen by the
kernel): the interpreter's first milliseconds (site, runpy) run before any of the program's
code and keep Python's defaults (docs/cli.md says so); on a loaded machine they can last
longer than 50 ms, so a wall-clock instant from exec would sometimes test Python, not us."""
HANDLERS_TIMEOUT_S = 30.0
EXPECTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


@pytest.fixture(scope="module")
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers: the command waits on its
    connection for as long as the test needs, with no database involved."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        yield listener.getsockname()[1]


def _wait_for_handlers(proc: subprocess.Popen[str]) -> None:
    """Until the kernel shows SIGTERM caught: Python catches only SIGINT by itself, so this
    is the launcher's first statement having run (typer, rich, psycopg not yet imported)."""
    deadline = time.monotonic() + HANDLERS_TIMEOUT_S
    status = Path(f"/proc/{proc.pid}/status")
    while time.monotonic() < deadline:
        caught = next(
            (line.split()[1] for line in status.read_text().splitlines()
             if line.startswith("SigCgt:")), "0",
        )  # fmt: skip
        if int(caught, 16) & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.001)
    raise AssertionError("the program never installed its signal handlers")


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
        _wait_for_handlers(proc)
        time.sleep(instant_ms / 1000)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == EXPECTED[signum], (instant_ms, proc.returncode, err)
        assert "Traceback" not in err, (instant_ms, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), (instant_ms, err)
        if instant_ms == 0:  # the handlers were there before the CLI's modules (~0.1 s)
            assert "while starting" in lines[0], err
        assert out == "", (instant_ms, out)
