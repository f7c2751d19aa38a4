"""Exponential backoff with jitter: a pure function, so it is unit-tested, not slept through.

"Equal jitter": half the exponential delay is fixed, half random, so a fleet of relays that
lost the broker together does not come back in lock-step, yet each one still waits long enough.
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
) -> float:
    """Delay before retry `attempt` (0 = first): in [d/2, d] with d = min(cap, base·2^n)."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    ceiling = min(cap_s, base_s * float(2 ** min(attempt, 62)))
    draw = float((rng or random).random())
    return ceiling / 2 + draw * ceiling / 2


def jitter_s(max_s: float = SERIALIZATION_RETRY_MAX_S, rng: random.Random | None = None) -> float:
    """A short random pause that de-synchronises two claimers that just collided."""
    return float((rng or random).random()) * max_s
