"""A logger that says the same kind of thing at most once per interval.

The switching relay checks its gate after every empty claim (many times a second when idle):
each "not yet" deserves a WARNING an operator can act on, not a flood of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 60.0


class RateLimitedLog:
    """`warning(key, …)` logs unless the same key was logged less than `interval_s` ago."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}

    def warning(self, key: str, message: str, *args: object) -> bool:
        """True when it was logged."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            return False
        self._last[key] = now
        self.logger.warning(message, *args, stacklevel=2)
        return True
