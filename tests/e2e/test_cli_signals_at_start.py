"""A signal at any instant of a command's life ends it with its exit code and one line, never
a traceback — including the first few hundred milliseconds, while typer, rich and psycopg
are still being imported.

Commands are started together and signalled with SIGINT at 20 instants (and SIGTERM at
ten), taken in turn by the commands: ten spread over 1.5 s counted from `exec` (the
interpreter starting, the program importing its modules, the command running: which one
depends on the machine's load) and ten over 1.5 s counted from the program's first statement
(its handlers in place, seen by the kernel), so the program's own imports and each command's
first moments are covered whatever the load. Before the program's first statement the interpreter's own
startup (`site`, `runpy`, stream set-up) runs with Python's defaults, which the program
cannot change (docs/cli.md says so): a signal there must still end the process with a
non-zero status, and is told apart by the kernel's view of the handlers at the moment it is
sent.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cli import ERROR_PREFIX

FROM_EXEC_MS = (0, 25, 50, 100, 200, 350, 500, 750, 1000, 1500)
FROM_HANDLERS_MS = (0, 5, 20, 50, 100, 200, 400, 700, 1000, 1500)
HANDLERS_TIMEOUT_S = 60.0
CONCURRENT = 6
"""Processes alive at once: most of a process's life here is waiting (for a server that
never answers, for the signal), so six keep two cores busy without starving the timing."""
EXPECTED = {signal.SIGINT: 130, signal.SIGTERM: 143}
BEFORE_THE_HANDLERS = ("outbox_migrate/__init__.py", "outbox_migrate/__main__.py",
                       "outbox_migrate/cli/__init__.py", "outbox_migrate/cli/launch.py",
                       "outbox_migrate/cli/signals.py")  # fmt: skip
"""The only files of the program (or of any installed package) that may run before its
handlers: the launcher's own, which import nothing heavy."""


@dataclass(frozen=True)
class Outcome:
    command: str
    signum: signal.Signals
    instant: str
    handlers_in: bool
    code: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return (
            f"{self.command} {self.signum.name} at {self.instant} (handlers "
            f"{'in' if self.handlers_in else 'not yet in'}): exit {self.code}\n"
            f"stdout: {self.stdout[-300:]!r}\nstderr: {self.stderr[-1500:]}"
        )


def _finished_first_help(o: Outcome) -> bool:
    return o.code == 0 and "Commands:" in o.stdout and o.stderr == ""


def _finished_first_wizard(o: Outcome) -> bool:
    """Without a terminal the wizard asks for its answers as options (exit 2, one line)."""
    lines = o.stderr.splitlines()
    return o.code == 2 and len(lines) == 1 and "--pause or --no-pause" in lines[0]


def _relay_stopped(o: Outcome) -> bool:
    """A service's stop once its command runs: nothing started, exit 0 (docs/cli.md)."""
    return o.code == 0 and o.stderr == "" and o.stdout == ""


def _never(_o: Outcome) -> bool:
    return False


COMMANDS: dict[str, tuple[tuple[str, ...], Callable[[Outcome], bool]]] = {
    "--help": (("--help",), _finished_first_help),
    "plan": (("plan", "--pattern", "hoper", "--dsn", "{dsn}"), _never),
    "status": (("status", "--dsn", "{dsn}"), _never),
    "relay": (("relay", "--sink", "stdout", "--dsn", "{dsn}"), _relay_stopped),
    "wizard": (("wizard",), _finished_first_wizard),
}
"""Each command and the other ending it may have when the signal comes too late to matter
(it finished first) or is, by the docs, its normal stop (the relay)."""
INSTANTS = [(True, ms) for ms in FROM_EXEC_MS] + [(False, ms) for ms in FROM_HANDLERS_MS]
"""(counted from exec?, milliseconds): the instants a signal is sent at."""
RUNS = [
    (name, signal.SIGINT, instant)
    for name, instant in zip(list(COMMANDS) * len(INSTANTS), INSTANTS, strict=False)
] + [
    (name, signal.SIGTERM, instant)
    for name, instant in zip(["plan", "status", "relay"] * 4, INSTANTS[::2], strict=False)
]
"""Each instant goes to the next command in turn, so every command sees instants over the
whole range; SIGTERM at every other instant."""


@pytest.fixture(scope="module")
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers: the command waits on its
    connection for as long as the test needs, with no database involved."""
    with socket.create_server(("127.0.0.1", 0), backlog=256) as listener:
        yield listener.getsockname()[1]


def _handlers_in(pid: int) -> bool:
    """Whether the kernel shows SIGTERM caught: Python catches only SIGINT by itself, so this
    is the launcher's first statement having run."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


def _signal_once(
    argv: tuple[str, ...], command: str, signum: signal.Signals, from_exec: bool, ms: int
) -> Outcome:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_MIGRATE_", "PG"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_migrate", *argv],
        stdin=subprocess.PIPE,  # kept open: nothing a command reads ends early
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        if not from_exec:
            deadline = time.monotonic() + HANDLERS_TIMEOUT_S
            while not _handlers_in(proc.pid) and proc.poll() is None:
                assert time.monotonic() < deadline, "the program never installed its handlers"
                time.sleep(0.001)
        time.sleep(ms / 1000)
        handlers_in = _handlers_in(proc.pid)  # read before sending: a late install is fine
        if proc.poll() is None:
            proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    instant = f"{ms} ms after {'exec' if from_exec else 'the handlers'}"
    return Outcome(command, signum, instant, handlers_in, proc.returncode, out, err)


def _verdict(outcome: Outcome, finished_first: Callable[[Outcome], bool]) -> str | None:
    """What is wrong with `outcome`, or None."""
    if not outcome.handlers_in:  # the interpreter's own startup: Python's defaults
        if outcome.code == 0 and not finished_first(outcome):
            return "exit 0 after a signal"
        ran = re.findall(r'File "([^"]+)"', outcome.stderr)
        late = [f for f in ran if "site-packages" in f or
                ("outbox_migrate/" in f and not f.endswith(BEFORE_THE_HANDLERS))]  # fmt: skip
        return f"code ran before the handlers: {late}" if late else None
    if "Traceback" in outcome.stderr:
        return "a traceback"
    if finished_first(outcome):
        return None
    lines = outcome.stderr.strip().splitlines()
    if outcome.code != EXPECTED[outcome.signum]:
        return f"exit {outcome.code}, not {EXPECTED[outcome.signum]}"
    if len(lines) != 1 or not lines[0].startswith(ERROR_PREFIX) or outcome.stdout:
        return "not one error line on stderr and nothing on stdout"
    return None


def test_a_signal_at_any_instant_of_any_command_exits_with_its_code_and_no_traceback(
    silent_server: int,
) -> None:
    dsn = f"host=127.0.0.1 port={silent_server} dbname=none user=nobody connect_timeout=30"
    jobs = [
        (tuple(a.format(dsn=dsn) for a in COMMANDS[name][0]), name, signum, from_exec, ms)
        for name, signum, (from_exec, ms) in RUNS
    ]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        outcomes = list(pool.map(lambda job: _signal_once(*job), jobs))
    wrong = [
        f"{verdict}: {o}"
        for o in outcomes
        if (verdict := _verdict(o, COMMANDS[o.command][1])) is not None
    ]
    assert not wrong, "\n\n".join(wrong)
    for name in COMMANDS:  # each command was interrupted, not only left to finish
        assert any(o.handlers_in and o.code == 130 for o in outcomes if o.command == name), name
    first = [o for o in outcomes if o.instant == "0 ms after the handlers"]
    assert first and all("while starting" in o.stderr for o in first), first
    # ^ the handlers were there before the CLI's modules were imported
