"""Shard ownership: which slice of the id space this session may claim from.

Each shard is a session-level advisory lock `(hashtext(key), shard)`. A session that holds it
is the only claimer of that shard, so two claimers never try to lock the same row — the cause
of SQLSTATE 40001 on the partitioned outbox. Locks die with the session, so a crashed relay's
shards are free at once; an idle worker adopts free shards (failover) and gives adopted ones
back when they run dry, so a restarted owner gets its home shards back.

Decisions are pure (`plan_*`); `ShardLease` only runs the two statements.
"""

from __future__ import annotations

import time
from typing import Any

from outbox_migrate.relay import queries

REBALANCE_S = 1.0
"""How often a worker retries its missing home shards and looks for orphaned ones."""


def home_shards(worker_index: int, workers: int, shards: int) -> list[int]:
    """Shards a worker owns by default: every `workers`-th one, starting at its index."""
    return [s for s in range(shards) if s % workers == worker_index]


class ShardLease:
    """The shards one worker's session holds."""

    def __init__(self, key: str, shards: int, home: list[int]) -> None:
        self.key = key
        self.count = shards
        self.home = list(home)
        self.owned: set[int] = set()
        self._next_check = 0.0

    @property
    def sharded(self) -> bool:
        return self.count > 1

    def mine(self) -> list[int]:
        return sorted(self.owned)

    def lost(self) -> None:
        """The session ended: every advisory lock went with it."""
        self.owned.clear()
        self._next_check = 0.0

    def maintain(self, conn: Any, *, idle: bool, now: float | None = None) -> bool:
        """Take missing home shards; when idle, adopt free ones. True when ownership changed."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return False
        self._next_check = now + REBALANCE_S
        before = set(self.owned)
        wanted = [s for s in self.home if s not in self.owned]
        # Adopt other shards only when idle (or a pure standby): a worker that just started
        # must not take its siblings' home shards before they had a chance to start.
        if idle or not self.home:
            wanted += [s for s in range(self.count) if s not in self.owned and s not in wanted]
        if wanted:
            rows = conn.execute(
                queries.try_lock_shards(), {"key": self.key, "shards": wanted}
            ).fetchall()
            self.owned.update(int(row[0]) for row in rows)
        return self.owned != before

    def release_adopted(self, conn: Any) -> bool:
        """Give back shards that are not home once they ran dry (their owner may return)."""
        adopted = [s for s in self.owned if s not in self.home]
        if adopted:
            conn.execute(queries.unlock_shards(), {"key": self.key, "shards": adopted})
            self.owned.difference_update(adopted)
        return bool(adopted)

    def release_all(self, conn: Any) -> None:
        if self.owned:
            conn.execute(queries.unlock_shards(), {"key": self.key, "shards": sorted(self.owned)})
            self.owned.clear()
