"""Exponential backoff with jitter: one pure function for every retry loop of the tool (the
relay's broker and database retries, the runner's and the jobs' lock retries).
"""

from __future__ import annotations

import random

BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 30.0
SERIALIZATION_RETRY_MAX_S = 0.02
"""Upper bound of the random pause before re-claiming after SQLSTATE 40001."""


def backoff_s(
    attempt: int,
    *,
    base_s: float = BACKOFF_BASE_S,
    cap_s: float = BACKOFF_CAP_S,
    rng: random.Random | None = None,
    full_jitter: bool = False,
) -> float:
    """Delay before retry `attempt` (0 = first), with d = min(cap, base·2^n): in [d/2, d], so a
    fleet that lost the broker together does not come back in lock-step yet each waits long
    enough; or in [0, d] with `full_jitter`, for a lock retry that wants its next try soon."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    ceiling = min(cap_s, base_s * float(2 ** min(attempt, 62)))
    draw = float((rng or random).random())
    if full_jitter:
        return draw * ceiling
    return ceiling / 2 + draw * ceiling / 2


def jitter_s(max_s: float = SERIALIZATION_RETRY_MAX_S, rng: random.Random | None = None) -> float:
    """A short random pause that de-synchronises two claimers that just collided."""
    return float((rng or random).random()) * max_s
