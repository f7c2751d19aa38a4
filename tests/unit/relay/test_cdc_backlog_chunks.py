"""The first start's backlog ids, kept as runs, handed out one batch at a time."""

from __future__ import annotations

import pytest

from outbox_migrate.relay.cdc.relay import IdRuns, chunks


@pytest.mark.parametrize(
    ("runs", "size", "expected"),
    [
        ([], 3, []),
        ([(1, 7)], 3, [[1, 2, 3], [4, 5, 6], [7]]),
        ([(1, 2), (5, 5), (9, 11)], 3, [[1, 2, 5], [9, 10, 11]]),
        ([(1, 1), (3, 3)], 1, [[1], [3]]),
        ([(10, 12)], 500, [[10, 11, 12]]),
    ],
)
def test_chunks_cover_every_id_once_in_order(
    runs: list[tuple[int, int]], size: int, expected: list[list[int]]
) -> None:
    assert list(chunks(runs, size)) == expected


def test_id_runs_keep_consecutive_ids_as_one_run_and_a_repeated_id_once() -> None:
    runs = IdRuns()
    for i in (3, 4, 5, 5, 9, 11, 12):
        runs.add(i)
    assert list(runs) == [(3, 5), (9, 9), (11, 12)]
    assert list(chunks(runs, 4)) == [[3, 4, 5, 9], [11, 12]]
