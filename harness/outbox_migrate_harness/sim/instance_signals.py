"""Imported by the demo's forkserver only (its preload list), for this side effect: SIGINT
ignored from the moment an instance process exists.

The forkserver records the SIGINT disposition it had after its preload imports and restores
it in every child it forks. With the default handler restored, a Ctrl-C (sent to the whole
terminal process group) that lands while a child is still in multiprocessing's bootstrap —
before the instance's own code ignores it — printed a KeyboardInterrupt traceback from that
child. Instances are stopped by the parent through their `stop` event instead.
"""

from __future__ import annotations

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
