"""Named SQL queries kept in `.sql` files, composed with `psycopg.sql` at use.

File format: a `-- name: <name>` line, one `-- ` description line, then the query. Inside a
query, `{placeholder}` marks an identifier or literal that the caller supplies as a
`psycopg.sql.Composable` (never a string), so quoting is always psycopg's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib.resources import files

from psycopg import sql

_HEADER = re.compile(r"^-- name: (?P<name>[a-z0-9-]+)\s*$", re.M)


@dataclass(frozen=True)
class NamedQuery:
    name: str
    description: str
    text: str

    def compose(self, **parts: sql.Composable) -> sql.Composed:
        return sql.SQL(self.text).format(**parts)


@cache
def load(file: str) -> dict[str, NamedQuery]:
    """Parse `outbox_migrate/sql/<file>.sql` into its named queries."""
    source = files(__package__).joinpath(f"{file}.sql").read_text(encoding="utf-8")
    queries: dict[str, NamedQuery] = {}
    matches = list(_HEADER.finditer(source))
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(source)
        body = source[match.end() : end].strip("\n")
        lines = body.splitlines()
        description = lines[0].removeprefix("--").strip() if lines else ""
        text = "\n".join(lines[1:]).strip().rstrip(";")
        queries[match["name"]] = NamedQuery(match["name"], description, text)
    return queries


def query(file: str, name: str) -> NamedQuery:
    try:
        return load(file)[name]
    except KeyError:
        raise KeyError(f"no query {name!r} in {file}.sql") from None
