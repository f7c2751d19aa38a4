"""Preloaded by the demo's forkserver for this side effect: SIGINT ignored from the moment an
instance process exists (instances are stopped through their `stop` event)."""

from __future__ import annotations

import signal

# The forkserver restores its post-preload disposition in every child: with the default one, a
# Ctrl-C during a child's multiprocessing bootstrap would print a traceback from that child.
signal.signal(signal.SIGINT, signal.SIG_IGN)
