"""Where a worker's next claim starts (docs/relay.md, "The cursor" and "Late rows"): a pure
decision, unit-tested without a database; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

MAX_ID_DIGITS = 20
"""A notification payload longer than this is no bigint id."""
GAP_PROBE_S = 0.05
"""How late a busy worker picks up a row that committed below the frontier."""
MAX_PROBE_IDS = 1_000
"""Gaps probed per claim at most, lowest first."""
GAP_TTL_S = 30.0
FULL_RESCAN_S = 60.0
KEY_SHARD_RESCAN_S = 1.0
RESCAN_COST_FACTOR = 100.0
"""A rescan that took t seconds puts the next one at least 100·t away: under a held xmin it
walks every dead index entry, and the backstop must cost about 1 % of the worker's time."""
MAX_PENDING_GAPS = 10_000
"""Beyond this many remembered gaps the cursor stops tracking and rescans from 0 instead."""
REGION_SETTLE_S = 0.25
"""Age of a region before its xmax is taken: a transaction gets its xid at its first write,
after `nextval`; a writer stalled longer between the two is left to the rescan."""


class _Region:
    """The unaccounted region: ids a transaction may still commit, with no gap list."""

    def __init__(self, opened: float) -> None:
        self.full = False
        """Everything below the frontier: resolved by one claim from id 0."""
        self.ids: set[int] = set()
        """Expired gaps: resolved by one probe of exactly these ids."""
        self.opened = opened
        self.horizon: int | None = None
        """pg_snapshot_xmax once the region had settled; resolved when xmin reaches it."""


class Cursor:
    def __init__(self, *, shards: int, mine: Sequence[int], track_gaps: bool, now: float) -> None:
        self.shards = shards
        self.mine = sorted(mine)
        self.track_gaps = track_gaps
        self.frontier = 0
        self.pending: dict[int, float] = {}
        """Gap id → when it was first seen."""
        self._next_probe = now + GAP_PROBE_S
        self._confirming = False
        """The next probe is the one before the worker sleeps: every gap, not MAX_PROBE_IDS."""
        self._lowered: int | None = None
        """A notified id below the frontier that was no remembered gap: start just below it."""
        self._rescan_s = FULL_RESCAN_S if track_gaps else KEY_SHARD_RESCAN_S
        self._next_full_rescan = now + self._rescan_s
        self._overflow = False
        self._region: _Region | None = None
        self._settled = False
        """A full region's writers have ended: claim from id 0 (not `_overflow`, which a gap
        walk in flight reads as "stop")."""
        self._final: set[int] = set()
        """Expired gaps whose writers have all ended: probed once more, then forgotten."""
        self._next_look = now + GAP_PROBE_S
        """While a region is open, when read-ahead gives way to a claim reading the horizon."""
        self._scheduled: dict[Any, float] = {}
        """Id → when a claim must start just below it (`retry_at`)."""

    def reset(self, mine: Sequence[int], now: float) -> None:
        self.mine = sorted(mine)
        self.frontier = 0
        self.pending.clear()
        self._overflow = False
        self._lowered = None
        self._next_full_rescan = now + self._rescan_s
        self._region = None  # the first claim, from id 0, opens a new one if it must
        self._settled = False
        self._final.clear()

    def retry_at(self, due: Mapping[Any, float]) -> None:
        """Id → when the first claim starts just below it: a parked key's message, on a clock
        rather than left to the rescan, which its own cost defers. Kept through `reset`."""
        self._scheduled.update(due)

    def _take_scheduled(self, now: float) -> Any:
        if not self._scheduled:
            return None
        ready = [i for i, when in self._scheduled.items() if when <= now]
        for message_id in ready:
            del self._scheduled[message_id]
        return min(ready) if ready else None

    def wait_s(self, now: float) -> float | None:
        if not self._scheduled:
            return None
        return max(0.0, min(self._scheduled.values()) - now)

    def start(self, now: float) -> int:
        self._next_look = now + GAP_PROBE_S
        scheduled = self._take_scheduled(now)
        if scheduled is not None:
            current = self._lowered if self._lowered is not None else self.frontier
            self._lowered = min(current, scheduled - 1)
        if now >= self._next_full_rescan or self._overflow or self._settled:
            self._next_full_rescan = now + self._rescan_s
            self._overflow = self._settled = False
            self._lowered = None
            self._confirming = False  # a claim from id 0 covers every gap
            return 0
        if self._lowered is not None:
            lowered, self._lowered = self._lowered, None
            return lowered
        return self.frontier

    def probe(self, now: float) -> list[int] | None:
        if not (self.pending or self._final) or now < self._next_probe:
            return None
        self._next_probe = now + GAP_PROBE_S
        everything, self._confirming = self._confirming, False
        expired = [gap for gap, seen in self.pending.items() if now - seen > GAP_TTL_S]
        if expired:
            # Likely rolled back; but a long transaction may still commit it: keep the ids in
            # the unaccounted region until the horizon says their writers have ended.
            region = self._open_region(now - REGION_SETTLE_S)
            for gap in expired:
                del self.pending[gap]
                region.ids.add(gap)
            if len(region.ids) > MAX_PENDING_GAPS:  # under a long-held xmin: bound the memory
                region.ids.clear()
                region.full = True
        final, self._final = self._final, set()
        if not (self.pending or final):
            return None
        gaps = sorted(final.union(self.pending))
        return gaps if everything else gaps[: MAX_PROBE_IDS + len(final)]

    def confirm(self) -> None:
        """The next claim is the last before the worker sleeps: probe every gap in it. A
        writer that saw the relay busy will not notify, and its row may lie below the
        frontier: left to the probe's period, the worker could sleep with it visible."""
        self._next_probe = 0.0
        self._confirming = True

    def notified(self, low: int) -> bool:
        """Rows from id `low` on committed. False when every id from `low` to the frontier
        was claimed already (a row the last claim found): no claim needed."""
        if low > self.frontier:
            return True  # the next claim from the frontier finds it
        if self.track_gaps:
            # Below the frontier, this worker's rows are gaps or in the region.
            due = any(gap >= low for gap in self.pending)
            if due:
                self._next_probe = 0.0
            region = self._region
            if region is None or not (region.full or any(i >= low for i in region.ids)):
                return due
        # Key shards, or an id the cursor has no gap for: claim from just below it once.
        current = self._lowered if self._lowered is not None else self.frontier
        self._lowered = min(current, low - 1)
        return True

    def notified_payloads(self, payloads: Iterable[bytes]) -> bool:
        """True when one of these payloads calls for a claim; one that is no id just wakes."""
        low: int | None = None
        high = 0
        other = False
        for payload in payloads:
            if payload.isdigit() and len(payload) < MAX_ID_DIGITS:
                notified = int(payload)
                low = notified if low is None else min(low, notified)
                high = max(high, notified)
            else:
                other = True
        if low is None:
            return other
        below = self.notified(low)  # first: it may make the probe due or lower the start
        return below or other or high > self.frontier

    def claimed(self, after: int, ids: Sequence[Any], now: float) -> None:
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

    def _open_region(self, opened: float) -> _Region:
        """The open region, with its horizon to be taken again (it covers more now)."""
        region = self._region
        if region is None:
            region = self._region = _Region(opened)
        region.opened, region.horizon = max(region.opened, opened), None
        return region

    def wants_horizon(self) -> bool:
        return self._region is not None

    def horizon(self, xmin: int, xmax: int, now: float) -> None:
        region = self._region
        if region is None:
            return
        if region.horizon is None:
            if now - region.opened >= REGION_SETTLE_S:
                region.horizon = xmax
            return
        if xmin < region.horizon:
            return  # a transaction that was running when the horizon was taken still runs
        # Every writer that could commit an id of the region has ended: one last look.
        self._region = None
        if region.full:
            self._settled = True
        if region.ids:
            self._final.update(region.ids)
            self._next_probe = 0.0

    def plain(self, now: float) -> bool:
        """Whether the next claim is a plain range claim from the frontier (read-ahead's)."""
        return not (
            self._lowered is not None
            or self.wait_s(now) == 0.0
            or self._overflow
            or self._settled
            or now >= self._next_full_rescan
            or ((self.pending or self._final) and now >= self._next_probe)
            or (self._region is not None and now >= self._next_look)
        )

    def due(self, now: float) -> bool:
        return (
            self._overflow
            or self._settled
            or bool(self._final)
            or self._lowered is not None
            or self.wait_s(now) == 0.0
        )

    def _gapless(self, low: int, ids: Sequence[int]) -> bool:
        """Whether `ids` are every id of this worker's shards in (low, ids[-1]], counted per
        shard rather than walked."""
        high = ids[-1]
        n = self.shards
        if n <= 1 or len(self.mine) == n:  # every id is this worker's (the usual one worker)
            expected = high - low
        else:
            expected = sum((high - s) // n - (low - s) // n for s in self.mine)
        above = len(ids) if ids[0] > low else sum(1 for i in ids if i > low)
        return above == expected

    def rescanned(self, seconds: float, now: float) -> None:
        self._next_full_rescan = max(self._next_full_rescan, now + RESCAN_COST_FACTOR * seconds)

    def force_full_rescan(self) -> None:
        """The next claim starts at id 0 (to prove "nothing left", not just "nothing new")."""
        self._overflow = True

    def retry_from(self, lowest: Any) -> None:
        self.frontier = min(self.frontier, lowest - 1)

    def retry_ids(self, ids: Sequence[Any], now: float) -> None:
        for row_id in ids:
            self.pending.setdefault(row_id, now)
        if ids:
            self._next_probe = 0.0

    def _remember_gaps(self, low: int, high: int, now: float) -> None:
        n = self.shards
        for shard in self.mine if n > 1 else [0]:
            first = low + 1 + ((shard - (low + 1)) % n) if n > 1 else low + 1
            for gap in range(first, high, n):
                if len(self.pending) >= MAX_PENDING_GAPS:
                    # All below the frontier is unaccounted now.
                    self._overflow = True
                    self.pending.clear()
                    self._open_region(now).full = True
                    return
                self.pending.setdefault(gap, now)


class NoCursor(Cursor):
    """Application ids: every claim starts at the beginning (queries.claim)."""

    def __init__(self, *, now: float) -> None:
        super().__init__(shards=1, mine=[], track_gaps=False, now=now)

    def start(self, now: float) -> int:
        self._take_scheduled(now)
        return 0

    def probe(self, now: float) -> list[int] | None:
        return None

    def notified(self, low: int) -> bool:
        return True  # no frontier: whatever was notified may be unclaimed

    def claimed(self, after: int, ids: Sequence[Any], now: float) -> None:
        return None

    def rescanned(self, seconds: float, now: float) -> None:
        return None

    def retry_from(self, lowest: Any) -> None:
        return None

    def retry_ids(self, ids: Sequence[Any], now: float) -> None:
        return None

    def force_full_rescan(self) -> None:
        return None

    def due(self, now: float) -> bool:
        return self.wait_s(now) == 0.0

    def wants_horizon(self) -> bool:
        return False

    def plain(self, now: float) -> bool:
        return False  # no frontier to claim after
