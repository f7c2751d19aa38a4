"""Where a worker's next claim starts: a pure decision, unit-tested without a database.

Why a cursor at all: a published row leaves a dead entry in the unpublished partition's index
until vacuum removes it, and while any transaction holds back xmin (an idle REPEATABLE READ
session, a long report) nothing can remove it. A claim that always starts at the lowest id
walks every one of those entries: throughput collapses as the dead entries pile up. Starting
each claim after the last id this worker claimed (the *frontier*) skips them.

The catch: ids are handed out at INSERT, rows become visible at COMMIT, so a row may appear
*below* the frontier after the frontier passed it (its transaction committed late). The cursor
therefore remembers the ids it jumped over (gaps between consecutive claimed ids that belong to
this worker's shards) and rescans from the lowest such id every GAP_RESCAN_S; a gap that stays
empty for GAP_TTL_S (a rolled-back insert) is forgotten, and a full rescan from id 0 every
FULL_RESCAN_S catches anything else. With key-hash shards a gap cannot be attributed to a
shard, so the cursor falls back to a full rescan every KEY_SHARD_RESCAN_S.
"""

from __future__ import annotations

from collections.abc import Sequence

GAP_RESCAN_S = 0.5
"""How late, at most, a row whose transaction committed after a higher id was claimed is
picked up (while its gap is remembered)."""
GAP_TTL_S = 30.0
FULL_RESCAN_S = 60.0
KEY_SHARD_RESCAN_S = 1.0
RESCAN_COST_FACTOR = 100.0
"""A rescan from id 0 that took t seconds puts the next timed one at least 100·t away: under a
held xmin such a claim walks every dead index entry left since, and the backstop must not
cost more than about 1 % of the worker's time."""
MAX_PENDING_GAPS = 10_000
"""Beyond this many remembered gaps the cursor stops tracking and rescans from 0 instead."""


class Cursor:
    """The claim start (`after`) of one worker, given its shards."""

    def __init__(self, *, shards: int, mine: Sequence[int], track_gaps: bool, now: float) -> None:
        self.shards = shards
        self.mine = sorted(mine)
        self.track_gaps = track_gaps
        self.frontier = 0
        self.pending: dict[int, float] = {}
        """Gap id → when it was first seen."""
        self._next_gap_rescan = now + GAP_RESCAN_S
        self._next_full_rescan = now + (FULL_RESCAN_S if track_gaps else KEY_SHARD_RESCAN_S)
        self._overflow = False

    def reset(self, mine: Sequence[int], now: float) -> None:
        """Shards changed or the session was lost: start over from id 0."""
        self.mine = sorted(mine)
        self.frontier = 0
        self.pending.clear()
        self._overflow = False
        self._next_full_rescan = now + (FULL_RESCAN_S if self.track_gaps else KEY_SHARD_RESCAN_S)

    def start(self, now: float) -> int:
        """`after` for the next claim (`id > after`)."""
        if now >= self._next_full_rescan or self._overflow:
            self._next_full_rescan = now + (
                FULL_RESCAN_S if self.track_gaps else KEY_SHARD_RESCAN_S
            )
            self._overflow = False
            return 0
        if self.pending and now >= self._next_gap_rescan:
            self._next_gap_rescan = now + GAP_RESCAN_S
            for gap, seen in list(self.pending.items()):
                if now - seen > GAP_TTL_S:
                    del self.pending[gap]
            if self.pending:
                return min(self.pending) - 1
        return self.frontier

    def claimed(self, after: int, ids: Sequence[int], now: float) -> None:
        """Record a claim that started at `after` and returned `ids` (ascending)."""
        if self.pending:
            for found in ids:
                self.pending.pop(found, None)
        if not ids or ids[-1] <= self.frontier:
            return
        if self.track_gaps and not self._gapless(max(after, 0, self.frontier), ids):
            previous = max(after, 0)
            for current in ids:
                if self._overflow:
                    break
                low = max(previous, self.frontier)
                if current > low + 1:
                    self._remember_gaps(low, current, now)
                previous = current
        self.frontier = ids[-1]

    def _gapless(self, low: int, ids: Sequence[int]) -> bool:
        """True when `ids` are every id of this worker's shards in (low, ids[-1]]: the usual
        batch, checked with one count per shard instead of a walk over every id."""
        high = ids[-1]
        n = self.shards
        if n <= 1:
            expected = high - low
        else:
            expected = sum((high - s) // n - (low - s) // n for s in self.mine)
        above = len(ids) if ids[0] > low else sum(1 for i in ids if i > low)
        return above == expected

    def rescanned(self, seconds: float, now: float) -> None:
        """A claim from id 0 took `seconds`: space the timed rescans by their cost."""
        self._next_full_rescan = max(self._next_full_rescan, now + RESCAN_COST_FACTOR * seconds)

    def force_full_rescan(self) -> None:
        """The next claim starts at id 0 (to prove "nothing left", not just "nothing new")."""
        self._overflow = True

    def retry_from(self, lowest: int) -> None:
        """Messages from `lowest` on must be claimed again (the sink rejected them)."""
        self.frontier = min(self.frontier, lowest - 1)

    def _remember_gaps(self, low: int, high: int, now: float) -> None:
        """Ids strictly between low and high that belong to this worker's shards."""
        n = self.shards
        for shard in self.mine if n > 1 else [0]:
            first = low + 1 + ((shard - (low + 1)) % n) if n > 1 else low + 1
            for gap in range(first, high, n):
                if len(self.pending) >= MAX_PENDING_GAPS:
                    self._overflow = True
                    self.pending.clear()
                    return
                self.pending.setdefault(gap, now)
