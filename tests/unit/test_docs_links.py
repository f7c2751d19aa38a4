"""Every relative link in the user docs resolves: the file (or folder) exists and a `#anchor`
names a heading of the target as GitHub renders it. Docs are reorganised often (benchmark runs
moved to bench/README.md, sections merged); a link that silently points nowhere is how a reader
loses the one paragraph they needed. No network: external (scheme) links are not checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) — not images' inner brackets or reference-style links; the target stops at
# the first space (an optional "title") or the closing parenthesis.
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"`[^`]*`")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks: a `# comment` in a shell example is no heading, and
    `[x](y)` inside code is no link."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed
    (letters, digits, `_`, `-` and spaces kept), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file offers; repeated headings get `-1`, `-2`… as on GitHub."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link that is not a URL with a scheme or a mailto."""
    found = []
    text = path.read_text(encoding="utf-8")
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            found.append((number, target))
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One line per link of `path` that does not resolve, named relative to `root`."""
    problems = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not resolved.exists():
            problems.append(f"{where} -> no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where} -> no heading #{anchor}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert doc.exists(), f"{doc.relative_to(ROOT)} is listed but missing"
    assert broken_links(doc) == []


def test_the_slug_rule_matches_githubs_for_headings_the_docs_use() -> None:
    """Anchors the docs already link to, as GitHub renders them."""
    assert github_slug("CDC mode (`--mode cdc`)") == "cdc-mode---mode-cdc"
    assert github_slug("Your table is not the spec's") == "your-table-is-not-the-specs"
    assert github_slug("Refused or too large: what each sink does") == (
        "refused-or-too-large-what-each-sink-does"
    )


def test_a_missing_file_and_a_missing_heading_are_both_reported(tmp_path: Path) -> None:
    """The checker itself can fail: a link to a file that is not there, and one to a heading
    that is not there, are each named with their line."""
    (tmp_path / "other.md").write_text("# Present heading\n", encoding="utf-8")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](other.md#present-heading)\n[gone](missing.md)\n[no anchor](other.md#absent)\n"
        "```sh\n[in code](nowhere.md)\n# not a heading\n```\n[self](#not-a-heading)\n",
        encoding="utf-8",
    )
    assert broken_links(doc, root=tmp_path) == [
        "doc.md:2: missing.md -> no such file",
        "doc.md:3: other.md#absent -> no heading #absent",
        "doc.md:8: #not-a-heading -> no heading #not-a-heading",
    ]
