"""`status --watch`: a frame every `--interval` seconds until Ctrl-C (or `--count` frames), as
plain text wrapped to the terminal. Nothing here reads or writes the database (cli/watch.py
reads the frames)."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

from outbox_migrate.cli.signals import Terminated
from outbox_migrate.cli.wording import status_line

CLEAR = "\x1b[H\x1b[2J"
BAR_WIDTH = 20


def _bar(fraction: float) -> str:
    filled = round(max(0.0, min(fraction, 1.0)) * BAR_WIDTH)
    return "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + f"] {fraction:4.0%}"


def _age(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:,.1f} s"


def _runner_lines(doc: dict[str, Any]) -> list[str]:
    runner = doc.get("runner")
    if runner is None:
        return ["runner: none at work on this table"]
    state = runner["state"] or "?"
    line = f"runner: pid {runner['pid']} ({runner['application'] or 'no name'}), {state}"
    line += f" for {_age(runner['for_s'])}"
    if runner["waiting_for_lock"]:
        line += f", waiting for a lock held by pid {', '.join(map(str, runner['blocked_by']))}"
    return [line]


def _step_lines(doc: dict[str, Any]) -> list[str]:
    step = doc.get("next_step")
    if step is None:
        return []
    lines = [f"next step: {step['id']}"]
    lines += [f"  needs {lock['mode']} on {lock['relation']}" for lock in step["locks"]]
    lines += [
        f"  blocked by pid {h['pid']} ({h['application'] or 'no name'}, {h['state'] or '?'}, "
        f"for {_age(h['for_s'])}) holding {h['mode']} on {h['relation']}"
        for h in doc.get("holders", [])
    ]
    if doc.get("checks"):
        lines.append("  not yet:")
        lines += [f"    {c['check']}: {c['observed']}" for c in doc["checks"]]
    return lines


def _switch_lines(doc: dict[str, Any]) -> list[str]:
    skipped = [f"rest of this frame skipped: {doc['skipped']}"] if doc.get("skipped") else []
    return skipped + [
        f"switching relay pid {r['pid']} waits ({r['seen_s_ago']:g} s ago): {r['why']}"
        for r in doc.get("switching_relays") or []
    ]


def _job_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    for table in doc.get("relay") or []:
        if "error" in table:
            lines.append(f"backlog of {table['table']}: unreadable ({table['error']})")
        else:
            oldest = f", oldest {_age(table['oldest_s'])}" if table["oldest_s"] is not None else ""
            lines.append(
                f"backlog of {table['table']}: {table['unpublished']:,} unpublished{oldest}"
            )
    copy = doc.get("copy_back")
    if copy is not None:
        total = copy["total"]
        done = f"{copy['rows']:,}" + (f"/{total:,}" if total else "") + " rows"
        bar = _bar(copy["rows"] / total) + " " if total else ""
        rate = f", {copy['rows_per_s']:,} rows/s" if copy["rows_per_s"] else ""
        eta = f", ETA {_age(copy['eta_s'])}" if copy["eta_s"] is not None else ""
        lines.append(f"copy-back ({copy['state']}): {bar}{done}{rate}{eta}")
    validate = doc.get("validate")
    if validate is not None:
        bar = _bar(validate["fraction"]) + " " if validate["fraction"] is not None else ""
        lines.append(
            f"VALIDATE (pid {validate['pid']}): {bar}{_age(validate['running_s'])} of "
            f"~{_age(validate['expected_s'])} ({validate['basis']})"
        )
    return lines


def render(doc: dict[str, Any], width: int, now: float | None = None) -> list[str]:
    """One frame as lines no wider than `width`; step ids are never cut (an id longer than
    the width stands alone on its line)."""
    clock = time.strftime("%H:%M:%S", time.localtime(now))
    head = status_line(doc) if doc["recorded"] else f"no migration recorded for {doc['table']}"
    raw = [
        f"{clock}  {head}",
        *_runner_lines(doc),
        *_step_lines(doc),
        *_switch_lines(doc),
        *_job_lines(doc),
    ]
    if doc["steps"]:
        widest = max(len(s["id"]) for s in doc["steps"])
        raw.append("steps:")
        raw += [f"  {s['id']:<{widest}}  {s.get('state', 'pending')}" for s in doc["steps"]]
    lines: list[str] = []
    for line in raw:
        lead = " " * (len(line) - len(line.lstrip()))
        lines += textwrap.wrap(
            line.lstrip(), width, initial_indent=lead, subsequent_indent=lead + "  ",
            break_long_words=False, break_on_hyphens=False,
        ) or [""]  # fmt: skip
    return lines


def watch(
    get_frame: Callable[[], dict[str, Any]],
    *,
    interval_s: float,
    count: int | None,
    json_lines: bool = False,
) -> None:
    """Print frames until Ctrl-C or until `count` frames were shown; with `json_lines`, one
    JSON document per frame and line. Ctrl-C is how a watch is left, not an error: it returns
    normally (exit 0). SIGTERM still ends it as the CLI's termination."""
    # A Ctrl-C mid-query leaves psycopg unable to roll back the read-only session as it
    # closes, which it reports at WARNING; for a watch that is the normal way out.
    quiet = logging.getLogger("psycopg")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        terminal = sys.stdout.isatty() and not json_lines
        shown = 0
        while count is None or shown < count:
            started = time.monotonic()
            document = get_frame()
            if json_lines:
                sys.stdout.write(json.dumps(document, default=str) + "\n")
            else:
                lines = render(document, shutil.get_terminal_size((80, 24)).columns)
                lead = CLEAR if terminal else ("\n" if shown else "")
                sys.stdout.write(lead + "\n".join(lines) + "\n")
            sys.stdout.flush()
            shown += 1
            if count is not None and shown >= count:
                break
            time.sleep(max(interval_s - (time.monotonic() - started), 0.0))
    except KeyboardInterrupt as exc:
        if isinstance(exc, Terminated):
            raise
        sys.stdout.write("\n")
        sys.stdout.flush()
    finally:
        quiet.setLevel(level)
