"""The proof harness: the spec's application under live load, rolled like a real deploy, and
its report (docs/demo.md)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from outbox_migrate_harness.sim.choreographer import Snapshot
    from outbox_migrate_harness.sim.scenario import Scenario


def simulate(
    dsn: str,
    recording_dsn: str,
    scenario: Scenario,
    *,
    on_snapshot: Callable[[Snapshot], None] | None = None,
    output_dir: Path | None = None,
    prepare: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the scenario and return its report; write PNG and HTML plots to `output_dir`.
    `prepare`: see `Choreographer`."""
    from outbox_migrate_harness.sim import report
    from outbox_migrate_harness.sim.choreographer import Choreographer

    data = Choreographer(
        dsn, recording_dsn, scenario, on_snapshot=on_snapshot, prepare=prepare
    ).run()
    result = report.build(data)
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        png = output_dir / f"{scenario.pattern}-timeline.png"
        # Interrupted: the partial report is written without the timeline, whose plotting
        # library alone takes longer to load than an interrupt may take (docs/demo.md).
        drawn = False if data.interrupted else report.plot_png(data, png)
        html = output_dir / f"{scenario.pattern}-report.html"
        report.write_html(result, png if drawn else None, html)
        result["files"] = {"png": str(png) if drawn else None, "html": str(html)}
    return result
