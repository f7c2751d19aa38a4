"""Fencing: never hand a batch to the broker unless this session provably still owns it.

Shards and batch rows are locks of the worker's session, which the server ends no earlier
than T (the session timeout) after its last message from the worker (relay/keepalive.py). So
when a claim sent at `t` returns, every lock is safe until at least `t + T`, and a batch is
published only if the publish (bounded by the sink's timeout) ends before `t + T - MARGIN_S`:
a relay cut off from PostgreSQL stops publishing before another can have claimed its shards.

Not covered: a process paused *inside* a sink call resumes after its session may have ended;
those messages arrive late, as duplicates (docs/relay.md, "Fleet guarantees").
"""

from __future__ import annotations

from outbox_migrate.errors import RelayError

MARGIN_S = 1.0
"""Clock and scheduling slack between our monotonic clock and the server's timers."""


class LeaseUnproven(RelayError):
    """The batch was not published: the lease could expire before the publish ends."""


class Fence:
    """When this worker last proved its session alive, and whether a publish still fits."""

    def __init__(self, session_timeout_s: float, publish_budget_s: float) -> None:
        self.session_timeout_s = session_timeout_s
        self.publish_budget_s = publish_budget_s
        self.proven_at = float("-inf")
        """Monotonic time a round trip that succeeded was sent."""

    @property
    def enabled(self) -> bool:
        return self.session_timeout_s > 0

    def proven(self, sent_at: float) -> None:
        """A statement sent at `sent_at` came back: the session was alive after that."""
        self.proven_at = max(self.proven_at, sent_at)

    def lost(self) -> None:
        """A new session holds nothing yet: no proof carries over."""
        self.proven_at = float("-inf")

    def deadline(self) -> float:
        """The last moment a publish may *start*."""
        return self.proven_at + self.session_timeout_s - MARGIN_S - self.publish_budget_s

    def check(self, now: float) -> None:
        """Raise `LeaseUnproven` when a publish starting `now` could outlive the lease."""
        if self.enabled and now > self.deadline():
            raise LeaseUnproven(
                f"shard lease proven {now - self.proven_at:.1f} s ago; a publish of up to "
                f"{self.publish_budget_s:g} s could end after the session timeout "
                f"({self.session_timeout_s:g} s)"
            )
