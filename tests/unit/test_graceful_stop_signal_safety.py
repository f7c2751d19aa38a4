"""A service's stop must not run inside the signal handler: the handler runs on the main
thread between two bytecodes, possibly while that thread holds the very lock the stop needs
(`threading.Event.set` takes the Event's condition lock, which `Event.wait` holds around its
wait). The stop is handed to a thread of its own through a pipe, which a handler may write."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import os, signal, threading
from outbox_migrate.cli import signals

stopped = threading.Event()
stopping = signals.GracefulStop()
stopping.attach(stopped.set)
with stopped._cond:  # the main thread holds the Event's lock as the signal lands
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):  # bytecodes: the handler runs here
        pass
print("stopped" if stopped.wait(10) else "not stopped", stopping.requested)
"""


def test_a_signal_while_the_main_thread_holds_the_stops_lock_does_not_deadlock() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=20, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["stopped", "True"]
