"""Shard ownership through session advisory locks: which slice of the id space this session
may claim from (docs/relay.md, "The claim, shards and ordering").
"""

from __future__ import annotations

import logging
import math
from typing import Any

from outbox_migrate.relay import queries

log = logging.getLogger("outbox_migrate.relay")

REBALANCE_S = 1.0
"""How often a worker re-counts the live workers and takes or gives back shards."""
UNTIL_EMPTY_PATIENCE_CHECKS = 3
"""`until_empty`: rebalance checks a worker without shards waits before it gives up."""


def home_shards(worker_index: int, workers: int, shards: int) -> list[int]:
    return [s for s in range(shards) if s % workers == worker_index]


def fair_share(shards: int, live_workers: int) -> int:
    return math.ceil(shards / max(1, live_workers))


def shards_to_release(owned: set[int], home: list[int], keep: int) -> list[int]:
    """Foreign ones first, highest first."""
    surplus = len(owned) - keep
    if surplus <= 0:
        return []
    ordered = sorted(owned, key=lambda s: (s in home, -s))
    return ordered[:surplus]


class ShardLease:
    def __init__(
        self, key: str, shards: int, home: list[int], reap_after_s: float | None = None
    ) -> None:
        self.key = key
        self.reap_after_s = reap_after_s
        self.members_key = f"{key}:members"
        self.count = shards
        self.home = list(home)
        self.owned: set[int] = set()
        self.checks = 0
        self._member = False
        self._next_check = 0.0

    @property
    def sharded(self) -> bool:
        return self.count > 1

    def mine(self) -> list[int]:
        return sorted(self.owned)

    @property
    def owns_all(self) -> bool:
        return len(self.owned) == self.count

    def due(self, now: float) -> bool:
        return now >= self._next_check

    def lost(self) -> None:
        self.owned.clear()
        self._member = False
        self._next_check = 0.0

    def maintain(self, conn: Any, *, now: float) -> bool:
        """Rebalance when due. True: this worker's shards changed."""
        if now < self._next_check:
            return False
        self._next_check = now + REBALANCE_S
        self.checks += 1
        before = set(self.owned)
        if not self._member:
            conn.execute(queries.named("join-members"), {"key": self.members_key})
            self._member = True
            # First round: home shards only, so sibling workers starting a moment later
            # find theirs free; fair shares are settled from the next round on.
            self._take(conn, list(self.home), len(self.home))
            return self.owned != before
        self.reap(conn)
        row = conn.execute(queries.named("count-members"), {"key": self.members_key}).fetchone()
        keep = fair_share(self.count, int(row[0]) if row else 1)
        give_back = shards_to_release(self.owned, self.home, keep)
        if give_back:
            conn.execute(queries.named("unlock-shards"), {"key": self.key, "shards": give_back})
            self.owned.difference_update(give_back)
        elif len(self.owned) < keep:
            candidates = [s for s in self.home if s not in self.owned]
            candidates += [
                s for s in range(self.count) if s not in self.owned and s not in candidates
            ]
            self._take(conn, candidates, keep - len(self.owned))
        return self.owned != before

    def reap(self, conn: Any) -> None:
        """End sessions that hold shards but have been silent past `reap_after_s`: the
        server arms its idle timers only after a Sync, so a relay frozen between a statement
        and its Sync (or after a Flush) would keep its shards for good."""
        import psycopg

        if self.reap_after_s is None:
            return
        try:
            rows = conn.execute(
                queries.named("end-idle-shard-holders"),
                {"key": self.key, "after_s": self.reap_after_s},
            ).fetchall()
        except psycopg.errors.InsufficientPrivilege as exc:
            log.warning(
                "relay.reap_refused %s (a frozen relay's shards wait for the server's own timers)",
                str(exc).strip().splitlines()[0],
            )
            self.reap_after_s = None
            return
        for pid, idle_s, done in rows:
            if done:
                log.warning(
                    "relay.reaped_session pid=%d silent_s=%.1f (held shards, client silent)",
                    pid,
                    idle_s,
                )

    def _take(self, conn: Any, candidates: list[int], limit: int) -> None:
        if not candidates or limit <= 0:
            return
        rows = conn.execute(
            queries.named("try-lock-shards"),
            {"key": self.key, "shards": candidates, "limit": limit},
        ).fetchall()
        self.owned.update(int(r[0]) for r in rows)

    def step_out(self, conn: Any) -> None:
        """Give back every shard and leave the members until the next `maintain`: as a
        member, a worker whose broker is away keeps the others' fair share too small."""
        self.release_all(conn)
        if self._member:
            conn.execute(queries.named("leave-members"), {"key": self.members_key})
            self._member = False
        self._next_check = 0.0

    def release_all(self, conn: Any) -> None:
        if self.owned:
            conn.execute(
                queries.named("unlock-shards"), {"key": self.key, "shards": sorted(self.owned)}
            )
            self.owned.clear()
