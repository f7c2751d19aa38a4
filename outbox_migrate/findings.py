"""`Finding`: one blocker, warning or note of `plan` — what was found and what to do — and the
quoting every fix it prints goes through.

Its own module so that the judges beside introspect.py (lost_semantics.py) can make findings
without importing introspect.py, which calls them.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql


@dataclass(frozen=True)
class Finding:
    """A blocker or warning: what was found and what to do."""

    code: str
    message: str
    remedy: str
    fix_sql: str = ""
    """The SQL the remedy prints, verbatim (the tests run it against the table it names):
    empty when the fix is a setting or a decision, not a statement."""


def ident(*parts: str) -> str:
    """An identifier as SQL text (`"Sales"."OutboxData"`), always quoted by psycopg, so a fix
    copied from `plan` runs on mixed-case names, on names that are keywords (`"offset"`) and in
    any schema, whatever the reader's search_path."""
    return sql.Identifier(*parts).as_string(None)


def literal(value: str) -> str:
    """A string literal as SQL text (a regclass name inside `setval('…')`, say)."""
    return sql.Literal(value).as_string(None)
