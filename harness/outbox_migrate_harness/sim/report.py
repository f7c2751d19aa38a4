"""The proof: counts, latencies (client-side, as the application feels them) and gaps from a
simulation run, and its plots; `lost` must be 0."""

from __future__ import annotations

import base64
import json
from itertools import pairwise
from pathlib import Path
from typing import Any

from outbox_migrate_harness.sim.choreographer import RunData

COLD = {"cop", "copra"}
MARKERS = {
    "deploy": ("tab:blue", "deploy of a version"),
    "step": ("tab:gray", "runner step"),
    "gate": ("tab:orange", "deploy gate said 'not yet'"),
    "stop": ("tab:purple", "old instances stopped"),
    "job": ("tab:brown", "job phase (copy-back)"),
    "refused": ("red", "runner refused"),
    "interrupted": ("black", "interrupted"),
}
"""Timeline marker kinds: colour and legend entry (every kind shown gets one)."""


def _percentile(values: list[float], pct: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered)) - 1))
    return ordered[index]


def build(data: RunData) -> dict[str, Any]:
    s = data.scenario
    produced = {key for w in data.writers for key in w.written}
    counts: dict[str, int] = data.received.get("counts", {})
    published = sum(1 for key in produced if counts.get(key, 0) > 0)
    lost_keys = sorted(key for key in produced if counts.get(key, 0) == 0)
    # Interrupted: the relays were stopped without draining, so unpublished rows are still
    # in the outbox (backlog), not lost; only what the backlog cannot account for is.
    lost = max(0, len(lost_keys) - data.backlog_left) if data.interrupted else len(lost_keys)
    duplicated = sum(c - 1 for c in counts.values() if c > 1)
    samples = [sample for w in data.writers for sample in w.samples]
    latencies = [lat for _, lat in samples]
    last_write = max((t for t, _ in samples), default=data.finished)
    receipts = [t for t, _ in data.received.get("timeline", [])]
    active = [t for t in receipts if t <= last_write]
    gaps = [b - a for a, b in pairwise(active)]
    lags = [lag for _, lag in data.received.get("timeline", [])]
    per_phase = []
    for name, start, end in data.phase_windows:
        window = [lat for t, lat in samples if start <= t < end]
        per_phase.append({
            "phase": name,
            "seconds": round(end - start, 1),
            "inserts": len(window),
            "max_insert_latency_ms": round(max(window, default=0) * 1000, 1),
            "p99_insert_latency_ms": round(_percentile(window, 99) * 1000, 1),
        })  # fmt: skip
    steps = []
    step_windows = [(r.started, (r.finished or data.finished) + 0.05) for r in data.steps]
    outside_steps = [lat for t, lat in samples if not any(a <= t <= b for a, b in step_windows)]
    for record in data.steps:
        end = record.finished or data.finished
        during = [lat for t, lat in samples if record.started <= t <= end + 0.05]
        steps.append({
            "step": record.step,
            "phase": record.phase,
            "outcome": record.outcome or "interrupted",
            "duration_ms": round((end - record.started) * 1000, 1),
            "attempts": record.attempts,
            "lock_timeouts": record.lock_timeouts,
            "lock_wait_ms": round(record.lock_wait_ms, 1),
            "max_insert_latency_ms_during": round(max(during, default=0) * 1000, 1),
        })  # fmt: skip
    report: dict[str, Any] = {
        "pattern": s.pattern,
        "rate_per_s": s.rate_per_s,
        "relays_per_version": s.relays,
        "writers_per_version": s.writers,
        "duration_s": round(data.finished - data.started, 1),
        "produced": len(produced),
        "published": published,
        "lost": lost,
        "lost_keys": lost_keys[:20],
        "duplicated": duplicated,
        "insert_errors": sum(w.failed for w in data.writers),
        "insert_error_samples": [e for w in data.writers for e in w.errors][:5],
        "max_insert_latency_ms": round(max(latencies, default=0) * 1000, 1),
        "p99_insert_latency_ms": round(_percentile(latencies, 99) * 1000, 1),
        # The machine's own noise floor: the longest insert while no step ran. A stall a
        # step causes is judged against lock_timeout on top of this, not against zero.
        "max_insert_latency_ms_outside_steps": round(max(outside_steps, default=0) * 1000, 1),
        "max_publish_gap_ms": round(max(gaps, default=0) * 1000, 1),
        "max_publish_lag_ms": round(max(lags, default=0) * 1000, 1),
        "lock_timeout_ms": s.lock_timeout_ms,
        "phases": per_phase,
        "steps": steps,
        "relay_errors": [r.error for r in data.relays if r.error],
        "backlog_left": data.backlog_left,
        "interrupted": data.interrupted,
        "refusal": data.refusal,
        "markers": [vars(m) | {"at": round(m.at - data.started, 3)} for m in data.markers],
    }
    if s.pattern in COLD:
        report["pause_ms"] = report["max_publish_lag_ms"]
    return report


def plot_png(data: RunData, path: Path) -> bool:
    """Insert latency and publish lag over time, deploys and steps marked. False without
    matplotlib (the `demo` extra)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
        from matplotlib.lines import Line2D
    except ImportError:
        return False
    t0 = data.started
    samples = [(t - t0, lat * 1000) for w in data.writers for t, lat in w.samples]
    timeline = [(t - t0, lag * 1000) for t, lag in data.received.get("timeline", [])]
    fig = Figure(figsize=(12, 7))
    top, bottom = fig.subplots(2, 1, sharex=True)
    for axis, points, color, label in ((top, samples, "tab:blue", "insert latency"),
                                       (bottom, timeline, "tab:green", "publish lag")):  # fmt: skip
        if points:
            axis.scatter(*zip(*points, strict=True), s=2, alpha=0.5, color=color, label=label)
        axis.set_ylabel(f"{label} (ms)")
        axis.set_yscale("log")
    top.axhline(data.scenario.lock_timeout_ms, color="red", linestyle=":", label="lock_timeout")
    bottom.set_xlabel("seconds since start")
    seen: set[str] = set()
    for marker in data.markers:
        x = marker.at - t0
        kind = marker.kind if marker.kind in MARKERS else "gate"
        seen.add(kind)
        for axis in (top, bottom):
            axis.axvline(x, color=MARKERS[kind][0], alpha=0.4, linewidth=0.8)
        if marker.kind in ("deploy", "refused", "job", "interrupted"):
            top.annotate(marker.label, (x, 0.98), xycoords=("data", "axes fraction"),
                         rotation=90, va="top", ha="right", fontsize=7,
                         annotation_clip=False,
                         bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none",
                               "alpha": 0.7})  # fmt: skip
    handles, _ = top.get_legend_handles_labels()
    handles += [
        Line2D([0], [0], color=color, linewidth=1.5, label=legend)
        for kind, (color, legend) in MARKERS.items()
        if kind in seen
    ]
    top.legend(handles=handles, loc="lower right", fontsize=7, framealpha=0.8)
    top.set_title(f"{data.scenario.pattern.upper()} under {data.scenario.rate_per_s} inserts/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_html(report: dict[str, Any], png: Path | None, path: Path) -> None:
    image = ""
    if png is not None and png.exists():
        encoded = base64.b64encode(png.read_bytes()).decode()
        image = f'<img alt="timeline" src="data:image/png;base64,{encoded}" width="100%">'
    rows = "".join(
        f"<tr><td>{s['step']}</td><td>{s['outcome']}</td><td>{s['duration_ms']}</td>"
        f"<td>{s['attempts']}</td><td>{s['lock_wait_ms']}</td>"
        f"<td>{s['max_insert_latency_ms_during']}</td></tr>"
        for s in report["steps"]
    )
    summary = {k: report[k] for k in ("produced", "published", "lost", "duplicated",
                                      "max_insert_latency_ms", "max_publish_gap_ms")}  # fmt: skip
    path.write_text(
        "<!doctype html><meta charset=utf-8><title>outbox-migrate demo</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
        "td,th{padding:2px 8px;border-bottom:1px solid #ddd}</style>"
        f"<h1>{report['pattern'].upper()} under live load</h1>"
        f"<pre>{json.dumps(summary, indent=2)}</pre>{image}"
        "<h2>Steps</h2><table><tr><th>step</th><th>outcome</th><th>ms</th><th>attempts</th>"
        f"<th>lock wait ms</th><th>max insert ms during</th></tr>{rows}</table>",
        encoding="utf-8",
    )
