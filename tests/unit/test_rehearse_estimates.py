"""Rehearse's scan estimates keep a step's fixed cost apart from its per-byte scan."""

from __future__ import annotations

from typing import Any

from outbox_migrate.rehearse import scan_estimates

MB = 1024 * 1024


def _report(scratch_bytes: int, scan_s: float, step_ms: float) -> dict[str, Any]:
    return {
        "source": {"heap_bytes": 20 * MB, "updates_per_s": 0},
        "scratch": {"heap_bytes": scratch_bytes, "scan_s": scan_s},
        "steps": [{"step": "hop.v4.validate-check", "duration_ms": step_ms, "lock_wait_ms": 0}],
    }


def test_a_tiny_copy_does_not_scale_its_fixed_cost() -> None:
    """100 rows: one 8 kB page scanned in 0.1 ms inside a 50 ms step. Scaling the whole step
    by 2,560 would predict two minutes for a 20 MB heap; the scan scales, the rest does not."""
    (estimate,) = scan_estimates(_report(8192, 0.0001, 50.0))
    assert estimate["estimated_s"] < 1.0
    assert estimate["fixed_s"] == 0.05
    assert estimate["sure"] is False and "rough" in estimate["basis"]


def test_a_copy_whose_scan_dominates_scales_with_the_bytes() -> None:
    (estimate,) = scan_estimates(_report(2 * MB, 0.25, 300.0))
    assert estimate["sure"] is True
    assert estimate["scale"] == 10.0
    assert 2.5 <= estimate["estimated_s"] <= 2.6  # 0.05 s fixed + 0.25 s x 10


def test_only_scan_steps_are_estimated() -> None:
    report = _report(8192, 0.001, 10.0)
    report["steps"][0]["step"] = "hop.v4.swap-default"
    assert scan_estimates(report) == []
