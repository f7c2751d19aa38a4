"""The switch gate's WARNINGs: each kind of "not yet" at most once a minute."""

from __future__ import annotations

import logging

import pytest

from outbox_migrate.relay.switching import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_one_warning_per_kind_per_minute(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    warn = RateLimitedLog(logging.getLogger("test.ratelimit"), interval_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        assert warn.warning("insert-privilege", "blocked %s", 1)
        for _ in range(100):
            clock.now += 0.5
            assert not warn.warning("insert-privilege", "blocked %s", 2)
        assert warn.warning("bypassing-sessions", "other kind")  # another kind: at once
        clock.now += 10.0  # 60 s since the first
        assert warn.warning("insert-privilege", "blocked %s", 3)
    assert [r.getMessage() for r in caplog.records] == ["blocked 1", "other kind", "blocked 3"]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
