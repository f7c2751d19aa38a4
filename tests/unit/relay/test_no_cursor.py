"""The cursor of application ids (uuid, ULID): every claim starts at the beginning of the
claim order, and nothing about it ever asks the worker to claim again before sleeping."""

from __future__ import annotations

from outbox_migrate.relay.cursor import NoCursor


def test_no_cursor_never_moves_and_never_keeps_an_idle_worker_awake() -> None:
    cursor = NoCursor(now=0.0)
    cursor.claimed(
        0, ["0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c"], 1.0
    )
    cursor.retry_from("0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b")
    cursor.notified(5)
    cursor.confirm()
    cursor.force_full_rescan()  # the worker asks for a claim from the start before sleeping
    assert cursor.start(2.0) == 0
    assert cursor.probe(2.0) is None
    # an idle worker sleeps: a "due" cursor would make it claim again at once, for ever
    assert not cursor.due(0.0)
    assert not cursor.wants_horizon()
    assert cursor.start(100.0) == 0 and not cursor.due(0.0)
