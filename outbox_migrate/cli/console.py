"""The only module that imports rich: everything printed for people goes through here.

Kept apart so `--help` and core code never pay for rich, and so core code stays silent.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any

from rich.console import Console
from rich.table import Table


@cache
def out() -> Console:
    return Console(highlight=False, soft_wrap=True)


@cache
def err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def print_json(data: Any) -> None:
    """Machine output: plain JSON on stdout, no colour, no wrapping."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def print_json_line(data: Any) -> None:
    """One compact JSON object per line (JSON-lines streams such as `run --format json`)."""
    sys.stdout.write(json.dumps(data, default=str) + "\n")
    sys.stdout.flush()


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    keep: Sequence[str] = (),
) -> None:
    """A table for people. Columns in `keep` (identifiers such as step ids) are never wrapped
    or truncated; the others wrap at word boundaries, so the table fits 80 columns."""
    from rich import box

    cells = [["" if cell is None else str(cell) for cell in row] for row in rows]
    grid = Table(title=title, show_lines=False, box=box.SIMPLE_HEAD if keep else box.HEAVY_HEAD)
    for index, column in enumerate(columns):
        if column in keep:
            widest = max([len(column), *(len(row[index]) for row in cells)])
            grid.add_column(column, no_wrap=True, min_width=widest)
        else:
            grid.add_column(column, overflow="fold")
    for row in cells:
        grid.add_row(*row)
    out().print(grid)


def text(message: str = "", *, style: str | None = None) -> None:
    out().print(message, style=style, markup=False)


def markup(message: str) -> None:
    out().print(message)


class RowProgress:
    """A progress bar for a row-copying job on stderr: rows, rows/s and an ETA.

    The rate and ETA are the job's own measurements (passed in), not rich's estimate, so the
    bar shows the same figures the job reports in JSON.
    """

    def __init__(self, description: str, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("rows"),
            TextColumn("{task.fields[rate]}"),
            TextColumn("ETA {task.fields[eta]}"),
            TextColumn("{task.fields[note]}"),
            console=err(),
            transient=False,
        )
        self._task = self._progress.add_task(description, total=total, rate="", eta="?", note="")

    def __enter__(self) -> RowProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(
        self,
        completed: int,
        total: int,
        rows_per_s: float,
        eta_s: float | None,
        note: str = "",
    ) -> None:
        eta = "?" if eta_s is None else _duration(eta_s)
        self._progress.update(
            self._task,
            completed=completed,
            total=total,
            rate=f"{rows_per_s:,.0f} rows/s",
            eta=eta,
            note=note,
        )


def _duration(seconds: float) -> str:
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def confirm(question: str) -> bool:
    """A yes/no question on the terminal (the wizard's interactive mode)."""
    from rich.prompt import Confirm

    return bool(Confirm.ask(question, console=out()))


def render_plan(doc: dict[str, Any]) -> None:
    """The terminal view of `plan`: one table per phase, steps with locks and rollback."""
    console = out()
    console.print(f"[bold]{doc['acronym']}[/bold]: {doc['title']}")
    console.print(doc["summary"], markup=False)
    facts = doc.get("facts")
    if facts:
        ids = (
            f"application ids claimed by {facts.get('claim_order')}, gates on "
            f"{facts.get('gate_sequence')}"
            if facts.get("id_kind") == "application"
            else f"max id {facts['max_id']}, new identity starts at {facts['identity_start']:,}"
        )
        console.print(
            f"Your outbox: PostgreSQL {facts['server_version']}, {facts['table']}, "
            f"~{facts['row_estimate']:,} rows, {facts['unpublished']:,} unpublished, {ids}",
            markup=False,
        )
        for warning in facts["warnings"]:
            console.print(f"warning: {warning['message']} — {warning['remedy']}", markup=False)
        for note in facts.get("notes", ()):
            console.print(f"note: {note['message']} — {note['remedy']}", markup=False)
        for obj in facts.get("objects", ()):
            console.print(f"{obj['kind']} {obj['name']}: {obj['fate']}", markup=False)
    for phase in doc["phases"]:
        console.print()
        console.print(f"[bold]{phase['name']}[/bold] ({phase['kind']}): {phase['title']}")
        console.print(f"  application: {phase['application']}", markup=False)
        for line in phase["instructions"]:
            console.print(f"  - {line}", markup=False)
        for line in phase.get("cdc_text", ()):
            console.print(f"  {line}", markup=False)
        if not phase["steps"]:
            continue
        grid = Table(show_lines=True)
        widest = max(len(step["id"]) for step in phase["steps"])
        grid.add_column("step", min_width=widest)  # ids never wrap; summaries wrap at spaces
        for column in ("locks", "scan", "checks", "rollback"):
            grid.add_column(column, overflow="fold")
        for step in phase["steps"]:
            locks = "\n".join(f"{lock['mode']} {lock['relation']}" for lock in step["locks"])
            grid.add_row(
                f"{step['id']}\n{step['summary']}",
                (locks or "none") + ("\n(catalog-only)" if step["catalog_only"] else ""),
                step["scan"],
                str(len(step["preconditions"])),
                step["reverse_note"] if step["reversible"] else "no: " + step["reverse_note"],
            )
        console.print(grid)


def render_recommendation(doc: dict[str, Any]) -> None:
    console = out()
    console.print(f"Recommended pattern: [bold]{doc['pattern'].upper()}[/bold]")
    for reason in doc["reasons"]:
        console.print(f"  - {reason}", markup=False)
    console.print("Not chosen:")
    for name, why in doc["rejected"].items():
        console.print(f"  - {name.upper()}: {why}", markup=False)
    for note in doc.get("notes", []):
        console.print(f"  * {note}", markup=False)
    following = doc.get("next") or f"outbox-migrate plan --pattern {doc['pattern']}"
    console.print(f"Next: {following}", markup=False)


class _TextRunnerEvents:
    """Runner progress for people: one line per step and per lock attempt."""

    def step_started(self, step: Any, action: str) -> None:
        if action == "already-done":
            return
        err().print(f"[bold]{step.id}[/bold] {step.summary}", highlight=False)

    def attempt(self, step: Any, log: Any) -> None:
        if log.outcome == "done":
            return
        blockers = ", ".join(b.describe() for b in log.blockers) or "unknown session"
        if log.outcome == "waiting":
            err().print(
                f"  attempt {log.attempt}: waiting, without queueing, for the lock held by "
                f"{blockers}",
                markup=False,
            )
            return
        err().print(
            f"  attempt {log.attempt}: lock not granted within the timeout "
            f"({log.waited_ms:.0f} ms); held by {blockers}; retrying",
            markup=False,
        )

    def step_finished(self, step: Any, outcome: str, elapsed_s: float) -> None:
        err().print(f"  {outcome} in {elapsed_s * 1000:.0f} ms", markup=False)

    def warning(self, step: Any, message: str) -> None:
        err().print(f"  warning: {message}", markup=False)

    def progress(self, step: Any, done: int, total: int, rate_per_s: float) -> None:
        err().print(f"  {done:,}/{total:,} rows ({rate_per_s:,.0f} rows/s)", markup=False)


class _JsonRunnerEvents:
    """Runner progress for CI logs: one JSON object per line on stdout."""

    def _emit(self, **fields: Any) -> None:
        sys.stdout.write(json.dumps(fields, default=str) + "\n")
        sys.stdout.flush()

    def step_started(self, step: Any, action: str) -> None:
        self._emit(event="step_started", step=step.id, action=action)

    def attempt(self, step: Any, log: Any) -> None:
        self._emit(event="attempt", step=step.id, attempt=log.attempt, outcome=log.outcome,
                   waited_ms=round(log.waited_ms, 1),
                   blockers=[vars(b) for b in log.blockers])  # fmt: skip

    def step_finished(self, step: Any, outcome: str, elapsed_s: float) -> None:
        self._emit(event="step_finished", step=step.id, outcome=outcome,
                   elapsed_ms=round(elapsed_s * 1000, 1))  # fmt: skip

    def warning(self, step: Any, message: str) -> None:
        self._emit(event="warning", step=step.id, message=message)

    def progress(self, step: Any, done: int, total: int, rate_per_s: float) -> None:
        self._emit(event="progress", step=step.id, done=done, total=total,
                   rate_per_s=round(rate_per_s, 1))  # fmt: skip


def runner_events(*, json_lines: bool) -> Any:
    return _JsonRunnerEvents() if json_lines else _TextRunnerEvents()


def render_status(doc: dict[str, Any]) -> None:
    console = out()
    console.print(
        f"{doc['pattern'].upper()} migration of {doc['table']}: {doc['state']}, completed "
        f"through {doc['phase']}"
        + (f", next {doc['next_phase']}" if doc.get("next_phase") else ""),
        markup=False,
    )
    rows = [
        (s["id"], s["state"], s.get("attempts", 0),
         f"{s['duration_ms']:.0f}" if s.get("duration_ms") is not None else "",
         f"{s.get('lock_wait_ms') or 0:.0f}")
        for s in doc["steps"]
    ]  # fmt: skip
    table(None, ["step", "state", "tries", "ms", "lock wait ms"], rows, keep=["step"])
    from outbox_migrate.cli.wording import without_prefix

    for s in doc["steps"]:  # errors below the table: they wrap, the ids above never do
        if s.get("last_error"):
            # The error itself often starts with the step id: say it once.
            error = without_prefix(str(s["last_error"]), s["id"])
            console.print(f"{s['id']}: {error}", markup=False)


@contextmanager
def demo_live(pattern: str) -> Iterator[Callable[[Any], None]]:
    """A live view of the simulation: phase, step, rates, backlog and lag."""
    from rich.live import Live

    def view(snapshot: Any) -> Table:
        grid = Table(title=f"outbox-migrate demo: {pattern.upper()}", show_header=False)
        grid.add_column("what")
        grid.add_column("value")
        grid.add_row("elapsed", f"{snapshot.elapsed_s:5.1f} s")
        grid.add_row("deployed", snapshot.phase)
        grid.add_row("runner step", snapshot.step or "-")
        grid.add_row("inserts/s", f"{snapshot.insert_rate_per_s:,.0f}")
        grid.add_row("published/s", f"{snapshot.publish_rate_per_s:,.0f}")
        grid.add_row("published", f"{snapshot.received:,}")
        grid.add_row("backlog", f"{snapshot.backlog:,}")
        grid.add_row("max lag (2 s)", f"{snapshot.max_lag_s * 1000:,.0f} ms")
        return grid

    with Live(Table(title=f"outbox-migrate demo: {pattern.upper()} starting…"),
              console=err(), refresh_per_second=4, transient=False) as live:  # fmt: skip

        def update(snapshot: Any) -> None:
            live.update(view(snapshot))

        yield update


def render_demo_report(report: dict[str, Any]) -> None:
    console = out()
    lost = report["lost"]
    verdict = "[green]nothing lost[/green]" if lost == 0 else "[red]LOST MESSAGES[/red]"
    if report.get("interrupted"):
        left = report["backlog_left"]
        verdict += f" [yellow](interrupted: a partial run, {left:,} left unpublished)[/yellow]"
    title = f"{report['pattern'].upper()}[/bold] at {report['rate_per_s']} inserts/s"
    console.print(f"\n[bold]{title}: {verdict}")
    summary = [
        ("produced", f"{report['produced']:,}"),
        ("published", f"{report['published']:,}"),
        ("lost", str(report["lost"])),
        ("duplicated", str(report["duplicated"])),
        ("max insert latency", f"{report['max_insert_latency_ms']} ms "
         f"(lock_timeout {report['lock_timeout_ms']} ms)"),
        ("p99 insert latency", f"{report['p99_insert_latency_ms']} ms"),
        ("longest publish gap", f"{report['max_publish_gap_ms']} ms"),
        ("max publish lag", f"{report['max_publish_lag_ms']} ms"),
    ]  # fmt: skip
    if "pause_ms" in report:
        summary.append(("publication pause (cold pattern)", f"{report['pause_ms']} ms"))
    table(None, ["measure", "value"], summary)
    table(
        "per phase",
        ["phase", "seconds", "inserts", "max insert ms", "p99 insert ms"],
        [(p["phase"], p["seconds"], p["inserts"], p["max_insert_latency_ms"],
          p["p99_insert_latency_ms"]) for p in report["phases"]],
    )  # fmt: skip
    table(
        "runner steps",
        ["step", "outcome", "ms", "tries", "lock wait ms", "max insert ms"],
        [(s["step"], s["outcome"], s["duration_ms"], s["attempts"], s["lock_wait_ms"],
          s["max_insert_latency_ms_during"]) for s in report["steps"]],
        keep=["step"],
    )  # fmt: skip
    refusal = report.get("refusal")
    if refusal:
        strand = refusal.get("would_strand", {})
        console.print(
            f"[bold red]refused[/bold red] {refusal.get('step')}: {refusal.get('observed')}",
        )
        console.print(
            f"rows that would have been stranded: {strand.get('count', 0)} "
            f"(ids {strand.get('first_ids', [])[:10]}…, keys {strand.get('first_keys', [])[:5]}…)",
            markup=False,
        )
    files = report.get("files") or {}
    for kind, path in files.items():
        if path:
            console.print(f"{kind}: {path}", markup=False)
