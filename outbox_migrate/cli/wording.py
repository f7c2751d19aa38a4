"""Plain-text wording for people-facing lines: plurals, prose wrapped without cutting a word,
commands split where the shell joins them. No rich here (console.py has it)."""

from __future__ import annotations

import re
import shlex
import textwrap
from typing import Any


def count(number: int, noun: str, plural: str | None = None) -> str:
    """`count(1, "step")` → "1 step"; `count(3, "step")` → "3 steps"."""
    word = noun if number == 1 else (plural or noun + "s")
    return f"{number:,} {word}"


def status_line(doc: dict[str, Any]) -> str:
    """The first line of `status` (and of each `status --watch` frame) for a recorded run."""
    following = f", next {doc['next_phase']}" if doc.get("next_phase") else ""
    return (f"{doc['pattern'].upper()} migration of {doc['table']}: {doc['state']}, completed "
            f"through {doc['phase']}{following}")  # fmt: skip


_BULLET = re.compile(r"^(\s*(?:[-*] |\d+\. )?)")
_NBSP = "\u00a0"  # textwrap splits on ASCII whitespace only: a no-break space holds words


def wrap_text(message: str, width: int, *, hang: int | None = None) -> list[str]:
    """Each line of `message` wrapped to `width` at spaces, never inside a word; its leading
    indent and bullet ("  - ") become the hanging indent of its continuation (or `hang`)."""
    out: list[str] = []
    for line in message.split("\n"):
        if len(line) <= width or not line.strip():
            out.append(line)
            continue
        lead = len(_BULLET.match(line).group(1)) if hang is None else hang  # type: ignore[union-attr]
        indent = " " * lead
        out += textwrap.wrap(
            line, width, subsequent_indent=indent, break_long_words=False,
            break_on_hyphens=False, replace_whitespace=False,
        ) or [line]  # fmt: skip
    return [line.replace(_NBSP, " ") for line in out]


def command_lines(command: str, width: int, indent: str = "  ") -> list[str]:
    """A shell command to copy and paste, on as many lines as it needs, each but the last
    ending in ` \\` (the shell joins them); arguments are never split, and an option stays
    with its value where it can."""
    words = shlex.split(command)
    units: list[str] = []
    for word in words:
        plain = word == shlex.quote(word) or _is_variable(word) or _is_redirect(word)
        quoted = word if plain else shlex.quote(word)
        last = units[-1] if units else ""
        takes_value = (last.startswith("-") or _is_redirect(last)) and " " not in last
        if takes_value and not word.startswith("-"):
            units[-1] += " " + quoted
        else:
            units.append(quoted)
    lines: list[str] = []
    current = indent
    for unit in units:
        candidate = f"{current} {unit}" if current.strip() else current + unit
        if current.strip() and len(candidate) + 2 > width:
            lines.append(current + " \\")
            current = indent + "  " + unit
        else:
            current = candidate
    lines.append(current)
    return lines


HELP_WIDTH = 78
"""Columns of a help paragraph: click lays help out at 80 at most, 2 of them its indent."""
_EXAMPLE = re.compile(r"Example: (outbox-migrate [^\n]+)")


def help_examples(text: str) -> str:
    """`text` (a command's help) with each `Example:` a paragraph click prints as it is (`\b`):
    click's own wrapping broke a long command at a hyphen (`--no-immediate-` / `access`), which
    no longer ran when pasted. Laid out here at whole arguments with ` \\` continuations."""

    def laid_out(match: re.Match[str]) -> str:
        return "\b\nExample:\n" + "\n".join(command_lines(match.group(1).strip(), HELP_WIDTH))

    return _EXAMPLE.sub(laid_out, text)


def _is_redirect(word: str) -> bool:
    """`>`, `2>>`, `|` in an example: the shell's, not an argument to quote."""
    return re.fullmatch(r"[0-9]?[<>|]{1,2}", word) is not None


def _is_variable(word: str) -> bool:
    """`$DATABASE_URL` as written in advice: left for the shell to expand."""
    return re.fullmatch(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", word) is not None


_ADVISED = re.compile(r"`(outbox-migrate [^`]+)`")


def split_advice(advice: str) -> tuple[str, list[str]]:
    """A `Next:` advice as prose and the commands it names, so the commands can be printed on
    lines of their own (copied whole) while the prose wraps: "deploy V2 (…), then
    `outbox-migrate run …`" → ("deploy V2 (…), then run:", ["outbox-migrate run …"])."""
    if advice.startswith("outbox-migrate "):
        return "", [advice]
    commands = _ADVISED.findall(advice)
    if not commands:
        return advice, []
    prose = _ADVISED.sub("", advice).strip().rstrip(",").strip()
    if prose.endswith(" then") or prose == "then":
        prose += " run:"
    elif prose:
        prose += ":"
    return prose, commands
