"""The idle flag's rules without a server (relay/idle_flag.py): when a worker raises the flag
with a claim, keeps it through a trickle, lowers it for dense or continuous traffic, sleeps,
and how soon it looks again when the flag could not be raised."""

from __future__ import annotations

from outbox_migrate.relay.idle_flag import AWAKE_WAITS, BUSY_POLL_CAP_S, SPARSE_ROWS, Idle, IdleFlag

KEY = 4242


def up() -> IdleFlag:
    """A flag raised with a claim that found nothing, its worker sleeping inside the run."""
    flag = IdleFlag(enabled=True, linger_s=0.005, run_key=KEY)
    flag.claimed(0, SPARSE_ROWS)
    assert flag.before_claim(SPARSE_ROWS) == (None, True)  # an empty claim: raise with the next
    flag.raised(KEY)
    flag.claimed(0, SPARSE_ROWS)
    assert flag.in_run(claim_due=False) is Idle.SLEEP
    assert flag.sleeping and flag.held
    return flag


def test_a_claim_after_an_empty_one_raises_the_flag_and_sleeps_when_it_finds_nothing() -> None:
    flag = up()
    assert flag.key == KEY and flag.busy_polls == 0


def test_a_trickle_keeps_the_flag_up_and_dense_traffic_lowers_it() -> None:
    flag = up()
    flag.slept(blocked=True)
    assert flag.before_claim(SPARSE_ROWS) == (None, False)  # still a trickle: keep it
    flag.claimed(SPARSE_ROWS, SPARSE_ROWS)
    assert flag.before_claim(SPARSE_ROWS) == (None, False)
    flag.claimed(SPARSE_ROWS + 1, SPARSE_ROWS)  # more than a trickle
    assert flag.before_claim(SPARSE_ROWS) == (KEY, False)  # unlocked with the next claim
    assert not flag.held and not flag.sleeping and not flag.tried


def test_waits_that_never_block_mean_continuous_traffic_and_lower_the_flag() -> None:
    flag = up()
    for _ in range(AWAKE_WAITS):
        flag.slept(blocked=False)
        flag.claimed(1, SPARSE_ROWS)
    assert flag.before_claim(SPARSE_ROWS) == (KEY, False)
    flag = up()
    flag.slept(blocked=False)
    flag.slept(blocked=True)  # one wait that blocked starts the count again
    flag.claimed(1, SPARSE_ROWS)
    assert flag.before_claim(SPARSE_ROWS) == (None, False)


def test_a_flag_that_could_not_be_raised_polls_soon_doubling_to_a_cap() -> None:
    flag = IdleFlag(enabled=True, linger_s=0.005, run_key=KEY)
    flag.claimed(0, SPARSE_ROWS)
    assert flag.before_claim(SPARSE_ROWS) == (None, True)  # tried, not granted
    flag.claimed(0, SPARSE_ROWS)
    waits = []
    for _ in range(6):
        assert flag.in_run(claim_due=False) is Idle.BUSY_POLL
        waits.append(flag.busy_poll_s())
    assert waits == [0.01, 0.02, 0.04, BUSY_POLL_CAP_S, BUSY_POLL_CAP_S, BUSY_POLL_CAP_S]
    flag.looked_up()
    assert flag.busy_poll_s() == 0.005
    assert flag.in_run(claim_due=True) is Idle.CLAIM  # a claim below the cursor comes first


def test_outside_a_run_the_flag_is_raised_then_confirmed_then_slept_on() -> None:
    flag = IdleFlag(enabled=True, linger_s=0.0)
    assert flag.idle() is Idle.RAISE
    assert flag.not_raised() == 0.002  # linger 0 counts as 1 ms, doubled once
    assert flag.idle() is Idle.RAISE
    flag.raised(KEY)
    assert flag.idle() is Idle.SLEEP and flag.sleeping  # the confirming claim found nothing
    assert flag.before_claim(-1) == (KEY, False)  # woken: the flag comes down with the claim
    assert IdleFlag(enabled=False, linger_s=0.0).idle() is Idle.SLEEP  # no notifications


def test_a_lost_session_loses_its_flag_and_a_sleeping_flag_is_lowered_once() -> None:
    flag = up()
    flag.session_lost()
    assert not flag.held and not flag.sleeping
    assert flag.lower() is None
    flag = up()
    assert flag.lower() == KEY and flag.lower() is None
    flag.claimed_ahead(0)
    assert flag.empty and flag.sparse
    flag.claimed_ahead(100)
    assert not flag.empty and not flag.sparse
