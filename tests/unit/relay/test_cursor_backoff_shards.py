"""Pure relay decisions: the claim cursor, backoff, shard assignment, options, envelopes."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime

import pytest

from outbox_migrate.backoff import backoff_s, jitter_s
from outbox_migrate.errors import RelayError
from outbox_migrate.relay.cursor import (
    FULL_RESCAN_S,
    GAP_PROBE_S,
    GAP_TTL_S,
    KEY_SHARD_RESCAN_S,
    MAX_PENDING_GAPS,
    MAX_PROBE_IDS,
    REGION_SETTLE_S,
    RESCAN_COST_FACTOR,
    Cursor,
)
from outbox_migrate.relay.message import Message
from outbox_migrate.relay.options import Mode, Ordering, RelayOptions, SwitchGate
from outbox_migrate.relay.shards import fair_share, home_shards, shards_to_release


def cursor(shards: int = 1, mine=(0,), track: bool = True) -> Cursor:
    return Cursor(shards=shards, mine=list(mine), track_gaps=track, now=0.0)


def test_cursor_advances_past_claimed_ids() -> None:
    c = cursor()
    assert c.start(0.1) == 0
    c.claimed(0, [1, 2, 3], 0.1)
    assert c.start(0.2) == 3
    assert c.pending == {}


def test_cursor_remembers_gaps_and_probes_them() -> None:
    c = cursor()
    c.claimed(0, [1, 2, 5, 6], 0.1)  # 3 and 4 not visible yet (in flight or rolled back)
    assert set(c.pending) == {3, 4}
    assert c.probe(0.01) is None  # before GAP_PROBE_S: keep going forward
    assert c.start(0.01) == 6
    assert c.probe(GAP_PROBE_S + 0.01) == [3, 4]  # claim exactly the gaps, by id
    assert c.probe(GAP_PROBE_S + 0.02) is None  # not again before the next period
    c.claimed(6, [3, 7], GAP_PROBE_S + 0.02)  # 3 committed late; 4 still missing; 7 is new
    assert set(c.pending) == {4}  # no false gaps recorded below the frontier (5, 6)
    assert c.frontier == 7


def test_a_notified_id_below_the_frontier_makes_the_probe_due_at_once() -> None:
    c = cursor()
    c.claimed(0, [1, 2, 5, 6], 0.0)
    c.notified(7)  # above the frontier: the next range claim finds it
    assert c.probe(0.01) is None  # GAP_PROBE_S has not passed
    c.notified(4)  # a statement with ids 4.. committed: gap 4 is among them
    assert c.probe(0.01) == [3, 4]
    assert c.start(0.01) == 6


def test_the_claim_before_sleeping_probes_every_gap_at_once() -> None:
    """After the idle flag is raised, the confirming claim must reach rows of writers that saw
    the relay busy (no NOTIFY) below the frontier: every remembered gap, probe period or not."""
    c = cursor()
    high = MAX_PROBE_IDS + 10
    c.claimed(0, [1, high], 0.0)  # ids 2 .. high-1 are gaps: more than one probe takes
    assert len(c.probe(GAP_PROBE_S)) == MAX_PROBE_IDS  # the periodic probe: lowest first
    assert c.probe(GAP_PROBE_S + 0.001) is None  # just probed: not due
    c.confirm()
    assert c.probe(GAP_PROBE_S + 0.001) == list(range(2, high))  # due, and every gap
    assert c.probe(GAP_PROBE_S + 0.002) is None  # once
    assert len(c.probe(3 * GAP_PROBE_S)) == MAX_PROBE_IDS  # periodic probes as before


def test_key_shards_claim_from_just_below_a_notified_id_once() -> None:
    c = cursor(shards=3, mine=[0], track=False)
    c.claimed(0, [1, 50], 0.0)
    c.notified(20)
    c.notified(30)
    assert c.start(0.1) == 19
    assert c.start(0.2) == 50


def test_cursor_forgets_gaps_after_ttl_and_rescans_fully() -> None:
    c = cursor()
    c.claimed(0, [1, 3], 0.0)
    assert c.probe(GAP_TTL_S + 1) is None  # id 2 is no longer probed every 50 ms
    assert c.start(GAP_TTL_S + 1) == 3
    assert c.pending == {}
    assert c.wants_horizon()  # ... but kept until its writer (if any) has surely ended
    assert c.start(FULL_RESCAN_S + 1) == 0


def test_an_expired_gap_is_probed_once_more_when_the_horizon_passes_its_writers() -> None:
    """A transaction open longer than GAP_TTL_S (the fuzzer's held INSERT) still commits."""
    c = cursor()
    c.claimed(0, [1, 3], 0.0)
    t = GAP_TTL_S + 1
    assert c.probe(t) is None
    c.horizon(100, 110, t)  # the expired gap is settled already: the horizon is xmax 110
    c.horizon(105, 112, t + 1)  # xid 105 (maybe the writer of id 2) still runs
    assert not c.due(0.0)
    c.horizon(110, 115, t + 2)  # every transaction below 110 has ended
    assert c.due(0.0)  # the worker claims before it sleeps
    assert c.probe(t + 2) == [2]  # one last probe by id
    assert not c.wants_horizon()
    assert c.probe(t + 3) is None and not c.due(0.0)


def test_ids_passed_without_a_gap_list_are_claimed_again_once_their_writers_ended() -> None:
    """The first claim of a fresh cursor jumps from id 0 to an outbox's lowest id (a million
    here): too many gaps to remember. Before, a row committed below the frontier after the
    overflow rescan waited for the once-a-minute rescan."""
    c = cursor()
    c.claimed(0, [1_000_002], 0.0)
    assert c.start(0.0) == 0  # the overflow rescan, as before
    c.claimed(0, [], 0.01)
    assert c.start(0.02) == 1_000_002
    assert c.wants_horizon()
    c.horizon(50, 60, REGION_SETTLE_S / 2)  # too soon: a writer may not have its xid yet
    c.horizon(61, 70, REGION_SETTLE_S)  # settled: horizon 70 (xmin 61 does not count)
    assert not c.due(0.0)
    c.horizon(69, 75, REGION_SETTLE_S + 0.1)
    assert not c.due(0.0)
    c.horizon(70, 75, REGION_SETTLE_S + 0.2)
    assert c.due(0.0) and not c.wants_horizon()
    assert c.start(REGION_SETTLE_S + 0.2) == 0  # the region's last look: from id 0
    assert not c.due(0.0)
    assert c.start(REGION_SETTLE_S + 0.3) == 1_000_002


def test_plain_claims_give_way_to_whatever_only_the_lease_session_does() -> None:
    """Read-ahead claims are plain range claims from the frontier (relay/read_ahead.py): the
    cursor says no while a probe, a rescan from id 0, a notified id or a horizon read is due,
    so those stay on the lease session, at most one probe period late."""
    c = cursor()
    c.start(0.0)
    c.claimed(0, [1, 2, 3], 0.0)
    assert c.plain(0.01)
    c.claimed(3, [4, 6], 0.02)  # 5 is a gap
    assert c.plain(0.03)  # the probe is not due yet
    assert not c.plain(GAP_PROBE_S + 0.01)  # now it is: the lease session claims
    assert c.probe(GAP_PROBE_S + 0.01) == [5]
    assert c.plain(GAP_PROBE_S + 0.02)
    c.notified(5)  # a late row below the frontier was notified
    assert not c.plain(GAP_PROBE_S + 0.02)
    assert c.probe(GAP_PROBE_S + 0.02) == [5]
    assert not c.plain(FULL_RESCAN_S)  # the once-a-minute rescan
    c.force_full_rescan()
    assert not c.plain(0.1)


def test_plain_claims_read_the_horizon_once_a_probe_period_while_a_region_is_open() -> None:
    c = cursor()
    c.claimed(0, [1_000_002], 0.0)  # jumped from 0: an unaccounted region opens
    assert c.start(0.0) == 0
    c.claimed(0, [], 0.01)
    assert c.start(0.02) == 1_000_002 and c.wants_horizon()
    assert c.plain(0.03)  # range claims may run ahead meanwhile...
    assert not c.plain(0.02 + GAP_PROBE_S)  # ...but a claim with the horizon comes first
    c.start(0.02 + GAP_PROBE_S)
    assert c.plain(0.03 + GAP_PROBE_S)


def test_a_region_settling_during_a_claim_keeps_that_claims_gaps() -> None:
    """The horizon is read in the claim's round trip, before the claim is recorded: settling
    the region then must not stop the gap walk of that claim (it did, as an overflow)."""
    c = cursor()
    c.claimed(0, [1_000_002], 0.0)
    assert c.start(0.0) == 0
    c.claimed(0, [], 0.0)
    c.horizon(1, 5, REGION_SETTLE_S)
    after = c.start(REGION_SETTLE_S + 0.1)
    c.horizon(5, 9, REGION_SETTLE_S + 0.1)  # settled, read with this claim
    c.claimed(after, [1_000_003, 1_000_005], REGION_SETTLE_S + 0.1)  # 1_000_004 in flight
    assert set(c.pending) == {1_000_004}
    assert c.start(REGION_SETTLE_S + 0.2) == 0  # and the region's last look follows


def test_a_notified_id_in_the_unaccounted_region_is_claimed_from_just_below_it() -> None:
    c = cursor()
    c.claimed(0, [1_000_002], 0.0)
    c.start(0.0)
    c.notified(1_000_001)  # the late writer notified at its commit (the relay was idle)
    assert c.due(0.0)
    assert c.start(0.01) == 1_000_000
    assert c.start(0.02) == 1_000_002
    fresh = cursor()
    fresh.claimed(0, [1, 2, 3], 0.0)
    fresh.notified(2)  # already claimed, no region: nothing to do
    assert not fresh.due(0.0) and fresh.start(0.01) == 3


def test_a_notification_says_whether_a_claim_must_follow() -> None:
    """An idle worker is woken only by notifications that can mean an unclaimed row: at
    1,000 msg/s most arrive just after the claim that already found their row."""
    c = cursor()
    c.claimed(0, [1, 2, 5, 6], 0.0)  # gaps 3 and 4
    assert c.notified(7)  # above the frontier
    assert not c.notified(6)  # claimed already, no gap at or above it
    assert c.notified(4)  # a remembered gap
    key_shards = cursor(track=False)
    key_shards.claimed(0, [1, 2, 3], 0.0)
    assert key_shards.notified(2)  # no gaps known: claim from just below it


def test_notifications_read_together_wake_for_any_unclaimed_row() -> None:
    """Several notifications read at once: the lowest id alone (what the cursor keeps) would
    say "claimed already" although a higher one is new — the row then waited for the next
    wake-up (measured: p99 0.6 → 4 ms at 1,000 msg/s)."""
    c = cursor()
    c.claimed(0, [1, 2, 3], 0.0)
    assert not c.notified_payloads([b"2", b"3"])  # both claimed
    assert c.notified_payloads([b"2", b"4"])  # 4 is new
    assert c.notified_payloads([b"order-created"])  # an application's payload: just wake
    assert c.notified_payloads([b"1", b""])
    assert c.notified_payloads([b"9" * 40])  # too long for an id: a plain wake


def test_cursor_gaps_only_in_own_shards() -> None:
    c = cursor(shards=4, mine=[1])
    c.claimed(0, [1, 13], 0.0)  # own shard: 1, 5, 9, 13 → 5 and 9 missing
    assert set(c.pending) == {5, 9}
    c2 = cursor(shards=4, mine=[0, 2])
    c2.claimed(0, [4, 12], 0.0)  # own: 2, 4, 6, 8, 10, 12 → 2, 6, 8, 10 missing
    assert set(c2.pending) == {2, 6, 8, 10}


class _WalkingCursor(Cursor):
    """The cursor without its gapless fast path: every claimed id is walked."""

    def _gapless(self, low: int, ids) -> bool:  # type: ignore[no-untyped-def]
        return False


@pytest.mark.parametrize("shards,mine", [(1, [0]), (4, [1]), (4, [0, 2, 3]), (8, list(range(8)))])
def test_cursor_fast_path_remembers_exactly_what_the_walk_does(
    shards: int, mine: list[int]
) -> None:
    """Random claims (with gaps, rescans below the frontier, repeats): the O(shards) gapless
    check must never hide a gap the id-by-id walk would have remembered."""
    rng = random.Random(shards * 100 + len(mine))
    fast, walk = cursor(shards, mine), _WalkingCursor(shards=shards, mine=mine, track_gaps=True,
                                                      now=0.0)  # fmt: skip
    own = [i for i in range(1, 3000) if shards == 1 or i % shards in mine]
    now = 0.0
    for _ in range(400):
        now += 0.01
        after = fast.start(now)
        assert walk.start(now) == after
        candidates = [i for i in own if i > after][: rng.randint(0, 30)]
        ids = [i for i in candidates if rng.random() > 0.05]  # some ids not visible yet
        fast.claimed(after, ids, now)
        walk.claimed(after, ids, now)
        assert fast.pending == walk.pending and fast.frontier == walk.frontier


def test_costly_rescans_from_zero_are_spaced_by_their_cost() -> None:
    """Under a held xmin a claim from id 0 walks every dead index entry: a 2 s rescan puts the
    next timed one 200 s away (about 1 % of the time), a cheap one changes nothing; a forced
    rescan (the "nothing left" proof) is never deferred."""
    c = cursor()
    c.claimed(0, [1, 2, 3], 0.0)
    c.rescanned(0.001, 0.0)
    assert c.start(FULL_RESCAN_S + 0.1) == 0  # cheap: the regular interval holds
    c.rescanned(2.0, FULL_RESCAN_S + 2.1)
    c.claimed(0, [4], FULL_RESCAN_S + 2.1)
    assert c.start(2 * FULL_RESCAN_S + 3) == 4  # deferred
    assert c.start(FULL_RESCAN_S + 2.1 + RESCAN_COST_FACTOR * 2.0 + 0.1) == 0
    c.rescanned(5.0, 500.0)
    c.force_full_rescan()
    assert c.start(500.1) == 0


def test_cursor_key_shards_fall_back_to_periodic_full_rescan() -> None:
    c = cursor(shards=3, mine=[0], track=False)
    c.claimed(0, [1, 50], 0.0)
    assert c.pending == {}
    assert c.start(0.5) == 50
    assert c.start(KEY_SHARD_RESCAN_S + 0.1) == 0


def test_a_parked_message_is_claimed_again_on_its_clock_not_the_rescans() -> None:
    """Key shards, whose rescans from id 0 a costly rescan spaced 100 s apart: a message due
    again at t=3 is reached by the first claim at or after t=3 (from just below it), the idle
    worker may sleep only until then, and the schedule is gone once taken. Before, only the
    next rescan from id 0 reached back to it (here: t=100)."""
    c = cursor(shards=3, mine=[0], track=False)
    c.claimed(0, [3, 30, 60], 0.0)
    c.rescanned(1.0, 0.0)  # the next timed rescan at t=100
    c.retry_at({30: 3.0})
    assert c.wait_s(1.0) == 2.0 and not c.due(1.0) and c.plain(1.0)
    assert c.start(2.9) == 60  # not yet
    assert c.due(3.0) and not c.plain(3.0) and c.wait_s(3.0) == 0.0
    assert c.start(3.0) == 29
    c.claimed(29, [30, 63], 3.0)
    assert c.wait_s(3.1) is None and c.start(3.1) == 63
    c.retry_at({60: 4.0, 30: 5.0})
    c.reset([0], 4.5)  # lost session: kept (a claim from 0 before 5.0 is not enough)
    assert c.start(4.5) == 0 and c.wait_s(4.5) == 0.5
    c.claimed(0, [63], 4.5)
    assert c.start(5.0) == 29


def test_cursor_overflow_and_forced_rescan() -> None:
    c = cursor()
    c.claimed(0, [1, MAX_PENDING_GAPS + 10], 0.0)
    assert c.pending == {}
    assert c.start(0.1) == 0
    c.claimed(0, [5], 0.2)
    c.force_full_rescan()
    assert c.start(0.3) == 0


def test_cursor_retry_moves_frontier_back() -> None:
    c = cursor()
    c.claimed(0, [1, 2, 3, 4], 0.0)
    c.retry_from(2)
    assert c.start(0.1) == 1


def test_backoff_grows_with_jitter_and_caps() -> None:
    rng = random.Random(7)
    delays = [backoff_s(n, base_s=0.1, cap_s=2.0, rng=rng) for n in range(10)]
    for n, delay in enumerate(delays):
        ceiling = min(2.0, 0.1 * 2**n)
        assert ceiling / 2 <= delay <= ceiling
    assert max(delays) <= 2.0
    assert 0 <= jitter_s(0.02, rng) <= 0.02
    with pytest.raises(ValueError):
        backoff_s(-1)


def test_home_shards_cover_every_shard_once() -> None:
    for workers, shards in [(1, 1), (2, 2), (3, 8), (4, 2)]:
        owned = [s for w in range(workers) for s in home_shards(w, workers, shards)]
        assert sorted(owned) == list(range(shards))


def test_options_validation() -> None:
    assert RelayOptions(workers=4).shard_count == 8
    assert RelayOptions(workers=12).shard_count == 12
    assert RelayOptions(workers=4, ordering=Ordering.global_).shard_count == 1
    assert RelayOptions(workers=2, shards=8).shard_count == 8
    with pytest.raises(RelayError):
        RelayOptions(batch_size=0)
    with pytest.raises(RelayError, match="old_app_name"):
        RelayOptions(mode=Mode.switching, switch_gate=SwitchGate.sessions)


def test_envelope_is_json_with_the_payload_embedded() -> None:
    message = Message(7, "public.outbox_new", 'quote"d', None, '{"a": [1, 2]}',
                      datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).isoformat())  # fmt: skip
    data = json.loads(message.envelope())
    assert data == {
        "id": 7, "table": "public.outbox_new", "event_type": 'quote"d', "key": None,
        "created_at": "2026-01-02T03:04:05+00:00", "payload": {"a": [1, 2]},
    }  # fmt: skip
    assert message.headers() == {
        "outbox-id": "7", "outbox-table": "public.outbox_new", "event-type": 'quote"d'
    }  # fmt: skip


def test_fair_share_and_release_order() -> None:
    assert fair_share(8, 2) == 4
    assert fair_share(4, 3) == 2
    assert fair_share(1, 5) == 1
    assert fair_share(4, 0) == 4
    # Down to 2 of {0, 2, 5, 7} with home [0, 2]: give back foreign shards, highest first.
    assert shards_to_release({0, 2, 5, 7}, [0, 2], 2) == [7, 5]
    assert shards_to_release({0, 4, 8}, [0, 4, 8], 1) == [8, 4]
    assert shards_to_release({1}, [1], 1) == []
