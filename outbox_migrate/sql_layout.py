"""Lay SQL text out to a width (docs/plan.md, "Applying `--format sql` with psql"): only lines
longer than the width are re-flowed, and only whitespace changes. Pure text in, text out; not
a formatter.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

CONTINUATION_INDENT = "    "
CLAUSES = frozenset({
    "FROM", "WHERE", "AND", "OR", "JOIN", "ON", "GROUP", "ORDER", "HAVING", "LIMIT", "UNION",
    "THEN", "ELSE", "WHEN", "INCLUDING", "RETURNING", "VALUES", "USING", "LOOP", "SELECT",
    "INTO", "SET", "PARTITION", "FOR",
})  # fmt: skip
"""Words a line may be broken before (when not nested deeper than another candidate)."""

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<comment>--.*)
  | (?P<literal>'(?:[^']|'')*')
  | (?P<ident>"(?:[^"]|"")*")
  | (?P<dollar>\$(?:[A-Za-z_][A-Za-z_0-9]*)?\$)
  | (?P<word>[A-Za-z_][A-Za-z_0-9$]*)
  | (?P<other>.)
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    depth: int
    """Parentheses open before this token, counted from the start of its line."""


_ROUTINE = re.compile(r"\s*CREATE\s+(?:OR\s+REPLACE\s+)?(?:FUNCTION|PROCEDURE)\b", re.I)
_DOLLAR = re.compile(r"\$(?:[A-Za-z_][A-Za-z_0-9]*)?\$")


def layout(text: str, width: int) -> str:
    """`text` with every line longer than `width` re-flowed, breaking only between tokens.
    A function's body is left as it is: PostgreSQL stores it verbatim, and re-flowed it would
    differ from the one `run` and Alembic create (a schema comparison would show it)."""
    out: list[str] = []
    statement = ""  # the statement's text so far, to know a function's header
    body_ends: str | None = None  # the dollar tag that closes the body being copied
    for line in text.split("\n"):
        if body_ends is not None:
            out.append(line)
            if body_ends in line:
                body_ends = None
        else:
            out.extend(_line(line, width))
            statement += line + "\n"
            tags = _DOLLAR.findall(line)
            opened = tags[-1] if tags and tags.count(tags[-1]) % 2 else None
            if opened and _ROUTINE.match(statement):
                body_ends = opened
        if line.rstrip().endswith(";") and body_ends is None:
            statement = ""
    return "\n".join(out)


def _line(line: str, width: int) -> list[str]:
    if len(line) <= width:
        return [line]
    indent = line[: len(line) - len(line.lstrip())]
    body = line.strip()
    if body.startswith("--"):
        return _comment(indent, body, width)
    if body.startswith("\\"):
        return [line]  # a psql meta-command ends at the end of its line
    tokens = _tokens(body)
    if tokens is None:
        return [line]  # an unterminated quote: part of a multi-line constant, leave it
    rest = indent + CONTINUATION_INDENT
    if tokens[-1].kind == "comment" and len(tokens) > 1:  # code, then its comment below it
        code = _flow(_rstrip(tokens[:-1]), indent, rest, width)
        return code + _comment(rest, tokens[-1].text, width)
    return _flow(tokens, indent, rest, width)


def _comment(indent: str, body: str, width: int) -> list[str]:
    """A `--` comment wrapped as comments: continuation lines indented under its text."""
    text = body[2:].strip()
    return textwrap.wrap(
        text, width, initial_indent=indent + "-- ", subsequent_indent=indent + "--   ",
        break_long_words=False, break_on_hyphens=False,
    ) or [indent + body]  # fmt: skip


def _tokens(body: str) -> list[_Token] | None:
    tokens: list[_Token] = []
    depth = 0
    position = 0
    while position < len(body):
        match = _TOKEN.match(body, position)
        if match is None or match.lastgroup is None:
            return None
        kind, piece = match.lastgroup, match.group()
        if kind == "other" and piece in "'\"":
            return None
        if piece == ")":
            depth = max(depth - 1, 0)
        tokens.append(_Token(kind, piece, depth))
        if piece == "(":
            depth += 1
        position = match.end()
    return tokens


def _flow(tokens: list[_Token], first: str, rest: str, width: int) -> list[str]:
    """Greedy: each output line ends at the best break that keeps it within `width`."""
    lines: list[str] = []
    prefix = first
    remaining = tokens
    while remaining:
        if remaining[0].kind == "comment":  # a trailing comment goes on lines of its own
            return lines + _comment(prefix, remaining[0].text, width)
        text = prefix + "".join(t.text for t in remaining)
        if len(text) <= width:
            lines.append(text)
            break
        cut = _best_break(remaining, len(prefix), width)
        if cut is None:
            split = _split_literal(remaining, len(prefix), width)
            if split is not None:
                head, tail = split
                lines.append(prefix + "".join(t.text for t in head))
                prefix, remaining = rest, tail
                continue
            cut = _first_break(remaining)
            if cut is None:  # one unbreakable token: leave it long
                lines.append(text)
                break
        lines.append(prefix + "".join(t.text for t in remaining[:cut]).rstrip())
        prefix = rest
        remaining = _lstrip(remaining[cut:])
    return lines


def _best_break(tokens: list[_Token], start: int, width: int) -> int | None:
    """Where to end the line (an index into `tokens`): among the breaks that keep it within
    `width` — at a space, or just after an opening parenthesis — the shallowest; at equal
    depth a clause keyword or a comma in the line's right half before any other space, a
    space before a parenthesis; then the rightmost."""
    fits: list[tuple[int, int, int]] = []  # (depth, rank, cut)
    column = start
    half = (width - start) // 2
    for index, token in enumerate(tokens):
        if token.kind == "space" and index > 0 and column <= width:
            following = tokens[index + 1] if index + 1 < len(tokens) else None
            clause = following is not None and following.text.upper() in CLAUSES
            rank = 0 if clause or tokens[index - 1].text == "," else 1
            if column - start < half:
                rank = 1  # a clause break that leaves a stub line is no better than a space
            if following is not None and following.kind != "comment":
                fits.append((token.depth, rank, index))
        column += len(token.text)
        if token.text == "(" and column <= width and index + 1 < len(tokens):
            fits.append((token.depth + 1, 2, index + 1))
        if column > width and fits:
            break
    if not fits:
        return None
    shallowest = min(depth for depth, _, _ in fits)
    best = min(rank for depth, rank, _ in fits if depth == shallowest)
    return max(cut for depth, rank, cut in fits if depth == shallowest and rank == best)


def _first_break(tokens: list[_Token]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t.kind == "space" and i > 0), None)


def _split_literal(
    tokens: list[_Token], start: int, width: int
) -> tuple[list[_Token], list[_Token]] | None:
    """Split the string constant that crosses `width` — alone, or with what is glued to it
    up to the next space (`'…',`) — into two adjacent constants (the first ends at a space
    inside it), or None when there is no such constant or space."""
    column = start
    for index, token in enumerate(tokens):
        end = column + len(token.text)
        glued = 0
        if token.kind == "literal":
            for after in tokens[index + 1 :]:
                if after.kind == "space":
                    break
                glued += len(after.text)
        if end + glued > width:
            if token.kind != "literal" or (index and tokens[index - 1].text[-1:] in "EeUu&"):
                return None  # only plain constants: E'' and U&'' continue differently
            room = width - column - 2 - glued  # the two quotes of the first part
            inner = token.text[1:-1]
            # At a space if there is one (the space ends the first part); else anywhere —
            # the joined constant is the same — but never between the quotes of ''.
            at = inner.rfind(" ", 0, max(room, 0)) + 1 or room
            while 0 < at < len(inner) and inner[:at].count("'") % 2:
                at -= 1
            if not 0 < at < len(inner):
                return None
            head = _Token("literal", "'" + inner[:at] + "'", token.depth)
            tail = _Token("literal", "'" + inner[at:] + "'", token.depth)
            return [*tokens[:index], head], [tail, *tokens[index + 1 :]]
        column = end
    return None


def _rstrip(tokens: list[_Token]) -> list[_Token]:
    while tokens and tokens[-1].kind == "space":
        tokens = tokens[:-1]
    return tokens


def _lstrip(tokens: list[_Token]) -> list[_Token]:
    while tokens and tokens[0].kind == "space":
        tokens = tokens[1:]
    return tokens
