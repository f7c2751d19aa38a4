"""Regression guard for issue 13's "waiting for a blocker without a brownout": the core of
bench/lock_wait.py in quick mode on the suite's server.

A session idle in transaction holds ACCESS SHARE on outbox_published (which the HOPER swap
needs in ACCESS EXCLUSIVE mode) for a few seconds while `run --to V4` runs and four writers
insert at 200/s. The watching runner must not stall them: on the 0.1 runner (queueing, every
attempt holding writers for up to lock_timeout) they kept about 60-80 % of their inserts.
"""

from __future__ import annotations

import sys

import pytest

from bench.lock_wait import create_seed, measure, prepare_v3

HOLD_S = 3.0
BASELINE_S = 3.0


@pytest.mark.newest_pg_only
def test_watching_runner_keeps_writers_going_while_a_blocker_holds_the_swap(dsn: str) -> None:
    create_seed(dsn)
    prepare_v3(dsn, HOLD_S)

    result = measure(dsn, "watching", hold_s=HOLD_S, baseline_s=BASELINE_S, out=sys.stderr)

    assert result.swap_applied, "the swap did not apply: outbox is not the DEFAULT partition"
    assert result.phase == "V4"
    assert result.rows_missing == 0
    # The swap waited for the blocker: it cannot have finished before the lock was released.
    assert result.run_to_swap_s >= HOLD_S
    assert result.baseline.done_share >= 0.85, result.baseline.summary()
    assert result.throughput_kept >= 0.90, result.summary()
    # Watching never queues behind a visible holder; at most one attempt may lose the race
    # with a holder that appeared between the look and the attempt.
    assert result.attempts.get("lock_timeout", 0) <= 1, result.attempts
