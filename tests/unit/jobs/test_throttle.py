"""The throttle's pure decisions: rate pauses and back-off steps."""

from __future__ import annotations

import pytest

from outbox_migrate.jobs.throttle import (
    MIN_PAUSE_S,
    ThrottlePolicy,
    next_backoff_s,
    probe_limit_ms,
    rate_pause_s,
)


def test_rate_pause_waits_until_the_rows_are_due() -> None:
    assert rate_pause_s(10_000, 0.5, 10_000) == pytest.approx(0.5)
    assert rate_pause_s(10_000, 1.5, 10_000) == 0.0  # behind schedule: no pause
    assert rate_pause_s(10_000, 0.0, None) == 0.0  # no ceiling


def test_backoff_doubles_while_over_budget_and_is_capped() -> None:
    policy = ThrottlePolicy(max_pause_s=0.1)
    pause = next_backoff_s(0.0, True, policy)
    assert pause == MIN_PAUSE_S
    steps = [pause := next_backoff_s(pause, True, policy) for _ in range(10)]
    assert steps[0] == pytest.approx(2 * MIN_PAUSE_S)
    assert max(steps) == 0.1


def test_backoff_halves_when_under_budget_and_reaches_zero() -> None:
    policy = ThrottlePolicy()
    pause = 0.08
    seen = []
    while pause > 0:
        pause = next_backoff_s(pause, False, policy)
        seen.append(pause)
    assert seen[:3] == [0.04, 0.02, 0.01]
    assert seen[-1] == 0.0


def test_probe_limit_has_a_floor_for_sub_millisecond_baselines() -> None:
    policy = ThrottlePolicy(probe_factor=1.5, probe_floor_ms=1.0)
    assert probe_limit_ms(0.2, policy) == pytest.approx(1.2)
    assert probe_limit_ms(10.0, policy) == pytest.approx(15.0)
