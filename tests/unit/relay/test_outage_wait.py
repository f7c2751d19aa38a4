"""How often a backing-off worker pings its session (relay/keepalive.py)."""

from __future__ import annotations

from outbox_migrate.relay.keepalive import MIN_PING_S, PING_SHARE, ping_interval_s


def test_a_session_is_pinged_several_times_within_its_idle_timeout() -> None:
    assert ping_interval_s(13.0) == 13.0 / PING_SHARE
    assert ping_interval_s(2.0) is not None and ping_interval_s(2.0) < 1.0


def test_no_timeout_no_pings_and_never_faster_than_the_floor() -> None:
    assert ping_interval_s(0.0) is None
    assert ping_interval_s(0.1) == MIN_PING_S
