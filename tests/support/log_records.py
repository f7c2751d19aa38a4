"""A logging handler that keeps every record: what an operator's root handler (stderr in the
CLI) would receive, for tests that check what reaches it."""

from __future__ import annotations

import logging


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
