"""The CLI as a live process: wait for it to reach a point, then signal it or cut its
database connection, and collect how it ended."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from signal import Signals
from typing import Any

import psycopg

APP_NAME_LIKE = "outbox-migrate/%"


@dataclass
class Ended:
    returncode: int
    stdout: str
    stderr: str


@dataclass
class LiveCli:
    """`python -m outbox_migrate ARGS` with stderr read line by line in the background."""

    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    stdin_fd: int | None = None
    new_session: bool = False
    """Own process group, as a terminal's foreground job: `signal_group` reaches every child."""

    def __post_init__(self) -> None:
        full = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}
        full["COLUMNS"] = "160"
        full.update(self.env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "outbox_migrate", *self.args],
            stdin=self.stdin_fd if self.stdin_fd is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full,
            start_new_session=self.new_session,
        )
        self._err: list[bytes] = []
        self._out: list[bytes] = []
        self._readers = [
            threading.Thread(target=self._pump, args=(self.proc.stderr, self._err), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stdout, self._out), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _pump(stream: object, sink: list[bytes]) -> None:
        # Chunks, not lines: a prompt waits for its answer without a newline.
        fd = stream.fileno()  # type: ignore[attr-defined]
        while chunk := os.read(fd, 4096):
            sink.append(chunk)

    def wait_for(self, text: str, *, stream: str = "stderr", timeout: float = 60) -> None:
        """Block until `text` appears in the output (the command reached that point)."""
        lines = self._err if stream == "stderr" else self._out
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in b"".join(list(lines)).decode(errors="replace"):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{text!r} never appeared; stderr: {b''.join(self._err)!r}")

    def signal(self, signum: Signals) -> None:
        self.proc.send_signal(signum)

    def signal_group(self, signum: Signals) -> None:
        """What Ctrl-C in a terminal does: the signal to every process of the job."""
        os.killpg(self.proc.pid, signum)

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def end(self, timeout: float = 60) -> Ended:
        self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return Ended(self.proc.returncode, b"".join(self._out).decode(errors="replace"),
                     b"".join(self._err).decode(errors="replace"))  # fmt: skip


def terminate_backends(dsn: str) -> int:
    """`pg_terminate_backend` every outbox-migrate session in the DSN's database (found by
    application_name): the server-side view of a lost connection."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE %s "
            "AND pid <> pg_backend_pid()",
            (APP_NAME_LIKE,),
        ).fetchall()
    return len(rows)


def until_counted(
    conn: psycopg.Connection[Any],
    query: str,
    params: Sequence[object] | None = None,
    *,
    timeout: float = 60,
    what: str = "",
) -> None:
    """Poll `query` (a count) until it is positive; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = conn.execute(query, params).fetchone()
        if row and row[0]:
            return
        time.sleep(0.05)
    raise AssertionError(f"not seen within {timeout:g} s: {what or query}")


def wait_for_backend(
    dsn: str, *, query_like: str = "%", waiting: bool = False, timeout: float = 60
) -> None:
    """Until an outbox-migrate session of this database runs a query matching `query_like`
    (with `waiting`, while it waits for a lock)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        until_counted(
            conn,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE %s AND query LIKE %s AND pid <> pg_backend_pid() "
            "AND state = 'active' AND (NOT %s OR wait_event_type = 'Lock')",
            (APP_NAME_LIKE, query_like, waiting),
            timeout=timeout,
            what=f"an outbox-migrate session running a query like {query_like!r}",
        )
