"""Privileges travel with the table: SQL that gives a relation the migration creates the old
table's owner and the grants the application needs on it (docs/patterns.md, "Owner, grants and
row-level security"). Inert SQL only; never connects.

The statement reads the grants from the catalog when it runs, so every way of applying a step
carries them as they stand then, and its text (its checksum) does not depend on who is granted.
"""

from __future__ import annotations

from psycopg import sql

from outbox_migrate import sql as queries
from outbox_migrate.patterns.names import Names

EVERY_PRIVILEGE = None
"""Carry every privilege the old table has (the parent)."""
RELAY_CLAIM_PRIVILEGES = ("SELECT", "UPDATE")
"""What the relay uses on the unpublished partition directly: the claim and its backlog."""
NO_PRIVILEGE: tuple[str, ...] = ()
"""Carry no grant, only the owner (the published partition)."""


def carry_privileges(n: Names, relation: str, privileges: tuple[str, ...] | None) -> sql.Composed:
    """A DO block giving `relation` the old table's grants (restricted to `privileges`; None:
    all of them) and then its owner (`privileges.sql`, `carry-privileges`).

    Grants first, owner last: the creating role owns the new relation until the ALTER OWNER,
    so it may grant; ALTER OWNER then rewrites the grantor of every grant to the new owner.
    Grantees are quoted by `regrole` output and `%I`, the server's own identifier quoting:
    they are only known to the catalog when the statement runs.
    """
    wanted = (
        sql.SQL("NULL::text[]")
        if privileges is None
        else sql.SQL("ARRAY[{}]::text[]").format(
            sql.SQL(", ").join(sql.Literal(p) for p in privileges)
        )
    )
    return queries.query("privileges", "carry-privileges").compose(
        old_reg=n.reg(n.table), new_reg=n.reg(relation), wanted=wanted
    )
