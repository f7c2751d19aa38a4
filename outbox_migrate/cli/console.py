"""The only module that imports rich: everything printed for people goes through here.

Kept apart so `--help` and core code never pay for rich, and so core code stays silent.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
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


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    grid = Table(title=title, show_lines=False)
    for column in columns:
        grid.add_column(column)
    for row in rows:
        grid.add_row(*("" if cell is None else str(cell) for cell in row))
    out().print(grid)


def text(message: str = "", *, style: str | None = None) -> None:
    out().print(message, style=style, markup=False)


def markup(message: str) -> None:
    out().print(message)
