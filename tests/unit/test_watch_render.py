"""The `status --watch` frame as text: progress bars, ETAs, and nothing wider than asked."""

from __future__ import annotations

from typing import Any

from outbox_migrate.cli.watch import render

LONG_ID = "hoper.copy-back.a-step-id-longer-than-any-terminal-is-wide-" + "x" * 40


def _doc(**extra: Any) -> dict[str, Any]:
    return {
        "recorded": True, "table": "public.outbox", "pattern": "hoper", "state": "active",
        "phase": "V4", "next_phase": "copy-back", "runner": None, "next_step": None,
        "holders": [], "checks": [], "relay": [], "copy_back": None, "validate": None,
        "steps": [{"id": LONG_ID, "state": "pending"}], **extra,
    }  # fmt: skip


def test_copy_back_and_validate_show_a_bar_a_rate_and_an_eta() -> None:
    doc = _doc(
        copy_back={"rows": 5_000, "total": 10_000, "rows_per_s": 800.0, "eta_s": 6.2,
                   "state": "copying"},
        validate={"pid": 7, "running_s": 3.0, "expected_s": 12.0, "fraction": 0.25,
                  "basis": "heap size at an assumed 200 MiB/s"},
    )  # fmt: skip
    text = " ".join(line.strip() for line in render(doc, 80))
    assert "copy-back (copying): [##########----------]  50% 5,000/10,000 rows" in text
    assert "800.0 rows/s, ETA 6.2 s" in text
    assert "VALIDATE (pid 7): [#####---------------]  25% 3.0 s of ~12.0 s" in text


def test_lines_fit_the_width_and_step_ids_are_never_cut() -> None:
    doc = _doc(checks=[{"check": "old-table-drained:outbox", "observed": "word " * 40}])
    doc["next_step"] = {"id": "hoper.v3.gate-old-table-retired", "locks": []}
    for width in (60, 80, 120):
        lines = render(doc, width)
        assert all(len(line) <= width for line in lines if LONG_ID not in line)
        assert any(LONG_ID in line for line in lines)


def test_a_waiting_switching_relay_and_a_skipped_frame_are_said() -> None:
    doc = _doc(
        switching_relays=[{"pid": 42, "waits": "privilege", "seen_s_ago": 0.4,
                           "why": "a login role still holds INSERT on the flat table"}],
        skipped="not read: a lock on it is held or requested by the migration (next frame)",
    )  # fmt: skip
    text = " ".join(line.strip() for line in render(doc, 80))
    assert "switching relay pid 42 waits (0.4 s ago): a login role still holds INSERT" in text
    assert "rest of this frame skipped: not read: a lock on it is held" in text
