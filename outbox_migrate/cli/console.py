"""The only module that imports rich: everything printed for people goes through here, so
`--help` and core code never load rich, and core code stays silent."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from outbox_migrate.jobs.copy_back import CopyProgress

# Lines are wrapped here (`_say`, `table`), to the terminal's width — 80 when it is not a
# terminal — so rich's own soft wrapping stays off: it would cut words it cannot place.


@cache
def out() -> Console:
    return Console(highlight=False, soft_wrap=True)


@cache
def err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def print_json(data: Any, *, indent: int | None = 2) -> None:
    """Machine output: plain JSON on stdout, no colour, no wrapping; `indent=None` writes one
    compact object per line (JSON-lines streams such as `run --format json`)."""
    sys.stdout.write(json.dumps(data, indent=indent, default=str) + "\n")
    sys.stdout.flush()


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    keep: Sequence[str] = (),
    lines: bool = False,
) -> None:
    """A table for people that fits the terminal: columns in `keep` (step ids) never wrap, the
    others never inside a word; where even that cannot fit, a block per row (`_records`)."""
    from rich import box

    console = out()
    cells = [["" if cell is None else str(cell) for cell in row] for row in rows]
    narrowest = [
        _narrowest(column, [row[index] for row in cells], whole=column in keep)
        for index, column in enumerate(columns)
    ]
    # Each column pads one space either side and the box draws a rule between and around
    # them: 3 per column + 1. Rich would squeeze a table that does not fit by cutting words.
    if sum(narrowest) + 3 * len(columns) + 1 > console.width:
        _records(console, title, columns, cells)
        return
    grid = Table(title=title, show_lines=lines,
                 box=box.SIMPLE_HEAD if keep else box.HEAVY_HEAD)  # fmt: skip
    for column, least in zip(columns, narrowest, strict=True):
        grid.add_column(column, no_wrap=column in keep, min_width=least)
    for row in cells:
        grid.add_row(*row)
    console.print(grid)


def _narrowest(header: str, values: Sequence[str], *, whole: bool) -> int:
    """The least width a column needs without cutting a word (or, `whole`, a line)."""
    pieces = [header, *values]
    if whole:
        return max(len(line) for piece in pieces for line in piece.splitlines() or [""])
    return max((len(word) for piece in pieces for word in piece.split()), default=1)


def _records(
    console: Console, title: str | None, columns: Sequence[str], cells: Sequence[Sequence[str]]
) -> None:
    """A table too wide for the terminal, one block per row (docs/cli.md, "Output for people")."""
    from outbox_migrate.cli.wording import wrap_text

    if title:
        _say(console, title)
    for row in cells:
        head, *rest = row[0].split("\n") if row else [""]
        lines = [(head, 0), *((f"  {line}", 2) for line in rest)]
        for column, value in zip(columns[1:], row[1:], strict=True):
            shown = "; ".join(value.splitlines()) or "-"
            lines.append((f"  {column}: {shown}", len(column) + 4))
        console.print()
        for line, hang in lines:
            for wrapped in wrap_text(line, console.width, hang=hang):
                console.print(wrapped, markup=False, highlight=False)


def _say(console: Console, message: str, *, style: str | None = None, bold: str = "") -> None:
    """`message` wrapped to the console's width (words never cut; an indented or bulleted
    line continues under its text); `bold` is a prefix of the first line to embolden."""
    from rich.text import Text

    from outbox_migrate.cli.wording import wrap_text

    for index, line in enumerate(wrap_text(bold + message, console.width)):
        shown = Text(line, style=style or "")
        if index == 0 and bold:
            shown.stylize("bold", 0, len(bold))
        console.print(shown)


def text(message: str = "") -> None:
    _say(out(), message)


def advice(following: str, label: str = "Next:") -> None:
    from outbox_migrate.cli.wording import command_lines, split_advice

    console = out()
    prose, commands = split_advice(following)
    if not prose and len(commands) == 1 and len(f"{label} {commands[0]}") <= console.width:
        console.print(f"{label} {commands[0]}", markup=False, highlight=False)
        return
    _say(console, f"{label} {prose}".rstrip())
    for command in commands:
        for line in command_lines(command, console.width):
            console.print(line, markup=False, highlight=False)


@contextmanager
def copy_progress(total: int, done: int) -> Iterator[Callable[[CopyProgress], None]]:
    """A progress bar for copy-back on stderr, and the callback that moves it. Its rate and
    ETA are the job's own measurements, not rich's estimate: the figures its JSON reports."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("rows"), TextColumn("{task.fields[rate]}"),
               TextColumn("ETA {task.fields[eta]}"), TextColumn("{task.fields[note]}")]  # fmt: skip
    with Progress(*columns, console=err(), transient=False) as progress:
        task = progress.add_task(
            "copy-back", total=total, completed=done, rate="0 rows/s", eta="?", note=""
        )

        def show(p: CopyProgress) -> None:
            progress.update(
                task, completed=p.copied_rows, total=p.total_rows,
                rate=f"{p.rows_per_s:,.0f} rows/s",
                eta="?" if p.eta_s is None else _duration(p.eta_s),
                note=f"paused {p.pause_s:.2f}s" if p.pause_s >= 0.05 else "",
            )  # fmt: skip

        yield show


def _duration(seconds: float) -> str:
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def confirm(question: str) -> bool:
    from rich.prompt import Confirm

    return bool(Confirm.ask(question, console=out()))


def render_plan(doc: dict[str, Any]) -> None:
    console = out()
    _say(console, f": {doc['title']}", bold=doc["acronym"])
    _say(console, doc["summary"])
    if doc.get("duplicate_ids"):
        _say(console, doc["duplicate_ids"])
    facts = doc.get("facts")
    if facts:
        ids = (
            f"application ids claimed by {facts.get('claim_order')}, gates on "
            f"{facts.get('gate_sequence')}"
            if facts.get("id_kind") == "application"
            else f"max id {facts['max_id']}, new identity starts at {facts['identity_start']:,}"
        )
        outbox = (
            f"Your outbox: PostgreSQL {facts['server_version']}, {facts['table']}, "
            f"~{facts['row_estimate']:,} rows, {facts['unpublished']:,} unpublished"
        )
        _say(console, f"{outbox}, {ids}")
        for warning in facts["warnings"]:
            _say(console, f"warning: {warning['message']} — {warning['remedy']}")
        for note in facts.get("notes", ()):
            _say(console, f"note: {note['message']} — {note['remedy']}")
        for obj in facts.get("objects", ()):
            _say(console, f"{obj['kind']} {obj['name']}: {obj['fate']}")
    for phase in doc["phases"]:
        console.print()
        _say(console, f" ({phase['kind']}): {phase['title']}", bold=phase["name"])
        _say(console, f"  application: {phase['application']}")
        for line in phase["instructions"]:
            _say(console, f"  - {line}")
        for line in phase.get("cdc_text", ()):
            _say(console, f"  {line}")
        if not phase["steps"]:
            continue
        rows = []
        for step in phase["steps"]:
            locks = "\n".join(f"{lock['mode']} {lock['relation']}" for lock in step["locks"])
            rows.append((
                f"{step['id']}\n{step['summary']}",
                (locks or "none") + ("\n(catalog-only)" if step["catalog_only"] else ""),
                step["scan"],
                str(len(step["preconditions"])),
                step["reverse_note"] if step["reversible"] else "no: " + step["reverse_note"],
            ))  # fmt: skip
        table(None, ["step", "locks", "scan", "checks", "rollback"], rows, lines=True)


def render_recommendation(doc: dict[str, Any]) -> None:
    console = out()
    console.print(f"Recommended pattern: [bold]{doc['pattern'].upper()}[/bold]")
    for reason in doc["reasons"]:
        _say(console, f"  - {reason}")
    console.print("Not chosen:")
    for name, why in doc["rejected"].items():
        _say(console, f"  - {name.upper()}: {why}")
    for note in doc.get("notes", []):
        _say(console, f"  * {note}")
    advice(doc.get("next") or f"outbox-migrate plan --pattern {doc['pattern']}")


class _TextRunnerEvents:
    def step_started(self, step: Any, action: str) -> None:
        if action == "already-done":
            return
        _say(err(), f" {step.summary}", bold=step.id)

    def attempt(self, step: Any, log: Any) -> None:
        if log.outcome == "done":
            return
        blockers = ", ".join(b.describe() for b in log.blockers) or "unknown session"
        if log.outcome == "waiting":
            _say(err(), f"  attempt {log.attempt}: waiting, without queueing, for the lock "
                 f"held by {blockers}")  # fmt: skip
            return
        _say(err(), f"  attempt {log.attempt}: lock not granted within the timeout "
             f"({log.waited_ms:.0f} ms); held by {blockers}; retrying")  # fmt: skip

    def step_finished(self, step: Any, outcome: str, elapsed_s: float) -> None:
        _say(err(), f"  {outcome} in {elapsed_s * 1000:.0f} ms")

    def warning(self, step: Any, message: str) -> None:
        _say(err(), f"  warning: {message}")

    def progress(self, step: Any, done: int, total: int, rate_per_s: float) -> None:
        _say(err(), f"  {done:,}/{total:,} rows ({rate_per_s:,.0f} rows/s)")


class _JsonRunnerEvents:
    def _emit(self, **fields: Any) -> None:
        print_json(fields, indent=None)

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


def render_status(doc: dict[str, Any], latest: dict[str, dict[str, Any]] | None = None) -> None:
    """`status` for people (docs/cli.md, "Output for people"); `latest` from
    `attempt_log.latest_attempts`."""
    from outbox_migrate.attempt_log import newer_than_error
    from outbox_migrate.cli.wording import status_line

    console = out()
    _say(console, status_line(doc))
    rows = [
        (s["id"], s["state"], s.get("attempts", 0),
         f"{s['duration_ms']:.0f}" if s.get("duration_ms") is not None else "",
         f"{s.get('lock_wait_ms') or 0:.0f}")
        for s in doc["steps"]
    ]  # fmt: skip
    table(None, ["step", "state", "tries", "ms", "lock wait ms"], rows, keep=["step"])
    for s in doc["steps"]:  # below the table: these lines wrap, the ids above never do
        attempt = (latest or {}).get(s["id"])
        if attempt is not None and newer_than_error(attempt, s):
            _say(console, f"{s['id']}: {_attempt_line(attempt)}")
        elif s.get("last_error"):
            # The error itself often starts with the step id: say it once.
            _say(console, f"{s['id']}: {str(s['last_error']).removeprefix(s['id'] + ': ')}")


def _attempt_line(attempt: dict[str, Any]) -> str:
    at = attempt["at"]
    when = at.strftime("%Y-%m-%d %H:%M:%S %Z") if hasattr(at, "strftime") else str(at)
    held = ", ".join(
        f"pid {b.get('pid')}" + (f" ({b['application_name']})" if b.get("application_name") else "")
        for b in attempt["blockers"][:3]
    )  # fmt: skip
    said = {"lock_timeout": "lock not granted within the timeout",
            "waiting": "waiting for its locks"}  # fmt: skip
    outcome = said.get(attempt["outcome"], attempt["outcome"])
    return (f"latest attempt {attempt['attempt']} at {when}: {outcome} "
            f"({attempt['waited_ms']:.0f} ms)" + (f"; held by {held}" if held else ""))  # fmt: skip


@contextmanager
def demo_live(title: str) -> Iterator[Callable[[Any], None]]:
    from rich.live import Live

    def view(snapshot: Any) -> Table:
        grid = Table(title=title, show_header=False)
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

    with Live(Table(title=f"{title} starting…"),
              console=err(), refresh_per_second=4, transient=False) as live:  # fmt: skip

        def update(snapshot: Any) -> None:
            live.update(view(snapshot))

        yield update
    if not err().is_terminal:  # the last frame ends without a newline off a terminal
        err().line()


def render_demo_report(report: dict[str, Any]) -> None:
    console = out()
    lost = report["lost"]
    verdict = "nothing lost" if lost == 0 else "LOST MESSAGES"
    console.print()
    _say(console, f" at {report['rate_per_s']} inserts/s: {verdict}",
         bold=report["pattern"].upper(), style="green" if lost == 0 else "red")  # fmt: skip
    if report.get("interrupted"):
        left = report["backlog_left"]
        _say(console, f"interrupted: a partial run, {left:,} left unpublished", style="yellow")
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
        _say(console, f" {refusal.get('step')}: {refusal.get('observed')}", bold="refused",
             style="red")  # fmt: skip
        _say(console,
            f"rows that would have been stranded: {strand.get('count', 0)} "
            f"(ids {strand.get('first_ids', [])[:10]}…, keys {strand.get('first_keys', [])[:5]}…)",
        )  # fmt: skip
    files = report.get("files") or {}
    for kind, path in files.items():
        if path:
            _say(console, f"{kind}: {path}")


def render_rehearsal_report(report: dict[str, Any]) -> None:
    source, scratch = report["source"], report["scratch"]
    render_demo_report(report)
    table(
        "source (read only)",
        ["measure", "value"],
        [
            ("table", source["table"]),
            ("server", source["server_version"]),
            ("rows (estimate)", f"{source['row_estimate']:,}"),
            ("unpublished", f"{source['unpublished']:,}"),
            ("heap", f"{source['heap_bytes']:,} bytes"),
            (
                f"rates over {source['measured_over_s']} s",
                f"{source['inserts_per_s']} ins/s, {source['updates_per_s']} upd/s, "
                f"{source['deletes_per_s']} del/s",
            ),
            ("copy", f"{scratch['rows']:,} rows at {scratch['rate_per_s']} inserts/s"),
        ],
    )
    estimates = []
    for item in report.get("extrapolated", []):
        if "estimated_s" in item:
            estimates.append(
                (item["step"], f"{item['scratch_s']} s", f"~{item['estimated_s']} s "
                 f"({item['fixed_s']} s fixed + {item['scan_s']} s scan at x{item['scale']}; "
                 f"{item['basis']})")
            )  # fmt: skip
        else:
            per_hour = item["estimated_s_per_hour_between_v2_and_swap"]
            estimates.append(
                (item["step"], f"{item['scratch_s']} s for {item['scratch_rows']:,} rows",
                 f"{item['rows_per_s']} rows/s; ~{per_hour} s per hour between V2 and the "
                 "swap" if per_hour is not None else f"{item['rows_per_s']} rows/s")
            )  # fmt: skip
    if estimates:
        table("at the real size", ["step", "scratch", "source (estimate)"], estimates,
              keep=["step"])  # fmt: skip
    for skipped in scratch["skipped"]:
        _say(out(), f"not carried to the copy: {skipped}")
