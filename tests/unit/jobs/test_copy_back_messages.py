"""What an operator reads when verification fails: the ranges, named, in one line."""

from __future__ import annotations

from outbox_migrate.errors import ExitCode
from outbox_migrate.jobs.copy_back import RangeCheck, Verification, VerificationFailed


def _range(low: int, source: int, target: int, same: bool = True) -> RangeCheck:
    return RangeCheck(low, low + 100, source, target, "a", "a" if same else "b")


def test_a_range_says_whether_rows_are_missing_or_different() -> None:
    assert _range(0, 100, 99).describe() == "ids [0, 100) (99 of 100 rows present)"
    assert _range(100, 100, 100, same=False).describe() == "ids [100, 200) (rows differ)"
    assert _range(200, 100, 100).ok
    assert not _range(300, 100, 100, same=False).ok


def test_verification_passes_only_with_every_row_matched() -> None:
    ok = Verification("s", "t", 10, 10, 1, (), 10)
    assert ok.passed
    assert not Verification("s", "t", 10, 9, 1, (), 10).passed
    assert not Verification("s", "t", 10, 10, 1, (_range(0, 5, 5, same=False),), 10).passed


def test_failure_message_is_one_line_and_caps_the_list() -> None:
    ranges = [_range(i * 100, 100, 99) for i in range(7)]
    error = VerificationFailed("public.outbox_published", "public.outbox", ranges)
    message = str(error)
    assert "\n" not in message
    assert "failed in 7 id range(s)" in message
    assert "ids [0, 100)" in message and "ids [400, 500)" in message
    assert "ids [500, 600)" not in message and "and 2 more" in message
    assert message.endswith("public.outbox_published was not dropped")
    assert error.exit_code == ExitCode.FAILED
    assert error.ranges == ranges
