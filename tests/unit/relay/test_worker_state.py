"""A polling worker's state is one type (relay/batch.py): its moves, and STOPPING is final."""

from outbox_migrate.relay.batch import Phase, WorkerState


def test_a_worker_starts_connecting_and_stopping_is_final() -> None:
    state = WorkerState()
    assert state.phase is Phase.CONNECTING
    state.to(Phase.CLAIMING)
    state.to(Phase.PUBLISHING)
    assert state.phase is Phase.PUBLISHING
    state.to(Phase.STOPPING)
    state.to(Phase.CLAIMING)
    state.park(1.0)
    assert state.phase is Phase.STOPPING


def test_a_park_leaves_its_pause_for_the_next_step_once() -> None:
    state = WorkerState()
    state.park(0.25)
    assert state.phase is Phase.PARKED
    assert state.unpark() == 0.25
    assert state.unpark() == 0.0


def test_backoff_grows_with_failures_in_a_row_and_a_served_run_resets_it() -> None:
    state = WorkerState()
    assert [state.back_off() for _ in range(3)] == [0, 1, 2]
    assert state.phase is Phase.BACKING_OFF
    state.served()
    assert state.back_off() == 0


def test_a_failed_mark_or_an_unmarked_batch_must_be_repaired_first() -> None:
    state = WorkerState()
    assert not state.must_repair()
    state.mark_failure = ValueError("duplicate key")
    assert state.must_repair()
