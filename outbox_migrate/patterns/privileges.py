"""Privileges travel with the table: SQL that gives a relation the migration creates the old
table's owner and the grants the application needs on it. Inert SQL only; never connects.

The grants are read from the catalog (`pg_class.relacl`, `pg_attribute.attacl`, through
`aclexplode`) *by the statement itself*, in the transaction that creates the relation: the
runner, `plan --sql` applied with psql days later and an Alembic revision (online or `--sql`)
all carry the privileges as they stand when the table is created, and the step's text (its
checksum) does not depend on who is granted what. `plan` shows the concrete grants it reads at
plan time (outbox_migrate/advisory/table_privileges.py).

What each new relation needs, and no more:

* the partitioned parent: every table and column privilege of the old table. The application
  (V2 and later) inserts, reads and marks through the parent; PostgreSQL checks privileges on
  the parent only for that, whatever partition the row lands in or moves to.
* the unpublished partition: SELECT and UPDATE only. The relay claims from it directly
  (`SELECT … FOR UPDATE SKIP LOCKED`, which needs UPDATE, and its backlog count) and marks
  through the parent.
* the published partition: no grant. Nothing of the application's reads it directly.

The relay's dead-letter tables and the DELETE a dead letter needs on the unpublished partition
are granted by their own step (kinds/dead_letter_tables.py), to the roles that mark.

Every relation also gets the old table's owner, so the application's owner role (and the
tools that run as it) keeps owning its outbox. Identity and serial ids need nothing: the parent
gets an identity of its own, and PostgreSQL does not check privileges on an identity's sequence.
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
