"""An interrupt Python drops: raised where exceptions are ignored (a module lock's weakref
callback, while a command imports lazily), it printed "Exception ignored … KeyboardInterrupt"
and the command went on — in CI the wizard then exited 2 with its usage error, not 130."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import weakref
from outbox_migrate.cli import app, signals

signals.install()


class Held:
    pass


held = Held()
ref = weakref.ref(held, lambda _: signals._on_signal(signals.{signal}, None))
del held  # the callback raises: Python ignores it, as in an import's lock callback
{ending}
"""


@pytest.mark.parametrize(("signal", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
@pytest.mark.parametrize(
    "ending", ["app._exit(0)", "app._fail('answer the question with --pause', 2)"]
)
def test_a_dropped_interrupt_still_ends_the_command_as_the_signal(
    signal: str, code: int, ending: str
) -> None:
    script = SCRIPT.format(signal=signal, ending=ending)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == code, done.stderr
    (line,) = done.stderr.strip().splitlines()  # no "Exception ignored" traceback
    assert line.startswith("outbox-migrate: error: ") and "Traceback" not in done.stderr


def test_other_unraisable_exceptions_still_reach_the_hook_before() -> None:
    script = """
import sys, weakref
from outbox_migrate.cli import signals
seen = []
sys.unraisablehook = lambda hook_args: seen.append(type(hook_args.exc_value).__name__)
signals.install()


class Held:
    pass


held = Held()
ref = weakref.ref(held, lambda _: 1 / 0)
del held
print(seen)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.stdout.strip() == "['ZeroDivisionError']", done.stderr
