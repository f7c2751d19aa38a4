"""The fence's arithmetic and the keepalive settings derived from one session timeout."""

from __future__ import annotations

import pytest

from outbox_migrate.errors import RelayError
from outbox_migrate.relay import keepalive
from outbox_migrate.relay.keepalive import MARGIN_S, Fence, LeaseUnproven
from outbox_migrate.relay.options import RelayOptions


def test_a_fresh_proof_lets_a_publish_start() -> None:
    fence = Fence(session_timeout_s=12.0, publish_budget_s=10.0)
    fence.proven(100.0)
    fence.check(100.5)  # 0.5 + 10 + 1 margin < 12


def test_a_publish_that_could_outlive_the_lease_is_refused() -> None:
    fence = Fence(session_timeout_s=12.0, publish_budget_s=10.0)
    fence.proven(100.0)
    with pytest.raises(LeaseUnproven, match="could end after the session timeout"):
        fence.check(100.0 + 12.0 - MARGIN_S - 10.0 + 0.01)


def test_no_proof_no_publish_and_a_new_session_starts_without_one() -> None:
    fence = Fence(session_timeout_s=12.0, publish_budget_s=1.0)
    with pytest.raises(LeaseUnproven):
        fence.check(0.0)
    fence.proven(50.0)
    fence.proven(40.0)  # an older round trip never moves the proof back
    assert fence.proven_at == 50.0
    fence.lost()
    with pytest.raises(LeaseUnproven):
        fence.check(50.0)


def test_a_zero_session_timeout_disables_the_fence() -> None:
    Fence(session_timeout_s=0.0, publish_budget_s=10.0).check(1e9)


def test_the_session_timeout_must_leave_room_for_a_publish() -> None:
    assert RelayOptions().dead_session_s == 12.0
    assert RelayOptions(sink_timeout_s=30.0).dead_session_s == 32.0
    assert RelayOptions(session_timeout_s=0).dead_session_s == 0
    with pytest.raises(RelayError, match="must exceed the sink timeout"):
        RelayOptions(sink_timeout_s=10.0, session_timeout_s=11.0)


def test_keepalive_settings_fit_inside_the_timeout() -> None:
    params = keepalive.libpq_params(12.0)
    assert params["tcp_user_timeout"] == 12000
    assert params["keepalives_idle"] + params["keepalives_interval"] <= 12
    server = keepalive.server_settings(12.0, 1.0, 18)
    assert server["tcp_user_timeout"] == "12000"
    assert server["idle_in_transaction_session_timeout"] == "12000"
    assert server["idle_session_timeout"] == "13000"
    assert "idle_session_timeout" not in keepalive.server_settings(12.0, 1.0, 13)
    assert keepalive.libpq_params(0) == {} and keepalive.server_settings(0, 1.0, 18) == {}
