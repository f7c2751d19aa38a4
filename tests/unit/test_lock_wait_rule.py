"""Which lock holders the runner waits for without queueing (pure rule, no server)."""

from __future__ import annotations

from outbox_migrate.errors import Blocker
from outbox_migrate.lock_budget import lasting


def holder(state: str, age: float | None, pid: int = 1) -> Blocker:
    return Blocker(pid, "app", state, age, "RowExclusiveLock", "outbox_new")


def test_idle_in_transaction_is_always_waited_for() -> None:
    for state in ("idle in transaction", "idle in transaction (aborted)"):
        assert lasting([holder(state, 0.0)], min_age_s=0.2) == [holder(state, 0.0)]


def test_old_transactions_are_waited_for_short_inserts_are_not() -> None:
    long_report = holder("active", 3.0, pid=2)
    insert = holder("active", 0.001, pid=3)
    unknown = holder("active", None, pid=4)  # e.g. a prepared transaction: no xact_start
    assert lasting([long_report, insert, unknown], min_age_s=0.2) == [long_report]


def test_the_threshold_is_the_lock_timeout() -> None:
    at = holder("active", 0.2)
    assert lasting([at], min_age_s=0.2) == [at]
    assert lasting([holder("active", 0.19)], min_age_s=0.2) == []
