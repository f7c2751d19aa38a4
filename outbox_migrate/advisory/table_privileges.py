"""Plan-time reading of the old table's owner, grants and row-level security: what `plan`
shows will travel to the partitioned outbox. Reads only; the carrying itself is SQL the
creating steps run (patterns/privileges.py), so this module never decides what is granted.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Any

from psycopg import Connection

from outbox_migrate import sql as queries
from outbox_migrate.advisory import ident
from outbox_migrate.config import OutboxSpec
from outbox_migrate.patterns.kinds.dead_letter_tables import (
    ATTEMPTS_TABLE_SUFFIX,
    DEAD_LETTER_TABLE,
)
from outbox_migrate.patterns.names import Names
from outbox_migrate.patterns.privileges import RELAY_CLAIM_PRIVILEGES

SWITCHING_PATTERNS = frozenset({"hop", "hoper", "hopia"})
"""Patterns whose V2 relay runs in switching mode (its default gate waits for a REVOKE)."""


@dataclass(frozen=True)
class Grant:
    grantee: str
    privilege: str
    column: str | None
    grantable: bool

    def text(self) -> str:
        column = f" ({self.column})" if self.column else ""
        return self.privilege + column + (" WITH GRANT OPTION" if self.grantable else "")


@dataclass(frozen=True)
class TablePrivileges:
    """The old table's owner and its grants to other roles, and its row-level security."""

    owner: str
    grants: tuple[Grant, ...]
    row_security: bool
    policies: int

    def objects(self, spec: OutboxSpec, pattern: str = "") -> list[tuple[str, str, str, str]]:
        """(kind, name, definition, fate) of the owner and of each grantee, for `plan`."""
        parent, unpublished = spec.partitioned_table, spec.unpublished_partition
        found = [(
            "owner", self.owner, f"owner of {spec.table}",
            f"owns {parent} and its partitions too (given in the transactions that create them)",
        )]  # fmt: skip
        for grantee, grants in groupby(self.grants, key=lambda g: g.grantee):
            held = list(grants)
            claim = [g.text() for g in held if g.privilege in RELAY_CLAIM_PRIVILEGES]
            held_text = ", ".join(g.text() for g in held)
            fate = f"{held_text}: granted on {parent} when it is created"
            if claim:
                fate += f"; {', '.join(claim)} also on {unpublished}, which the relay claims from"
            if any(g.privilege == "UPDATE" and g.column is None for g in held):
                # The relay's role (it marks): what dead-lettering needs (its step).
                fate += (
                    f"; DELETE on {unpublished} and SELECT, INSERT, UPDATE, DELETE on "
                    f"{DEAD_LETTER_TABLE} and {DEAD_LETTER_TABLE}{ATTEMPTS_TABLE_SUFFIX} "
                    "(the relay's dead letters)"
                )
            # REVOKE INSERT ON the table also takes back INSERT granted on columns.
            if pattern in SWITCHING_PATTERNS and any(g.privilege == "INSERT" for g in held):
                fate += (
                    f"; V2's switching relay leaves {spec.table} once nobody can insert into "
                    f"it: after V1 is gone, as {self.owner}: REVOKE INSERT ON "
                    f"{ident(spec.schema, spec.table)} FROM {grantee}"
                )
            found.append(("grant", grantee, held_text, fate))
        return found

    def blockers(self, spec: OutboxSpec) -> list[tuple[str, str, str]]:
        """(code, message, remedy): row-level security is refused, not carried."""
        if not (self.row_security or self.policies):
            return []
        return [(
            "row-security",
            f"{spec.table} has row-level security "
            f"({'enabled' if self.row_security else 'disabled'}, {self.policies} policies)",
            f"its policies are not carried to {spec.partitioned_table} and its partitions: "
            f"disable it for the migration (ALTER TABLE {ident(spec.schema, spec.table)} "
            "DISABLE ROW LEVEL SECURITY, DROP POLICY …) and re-create the policies on the "
            "partitioned table yourself, or migrate by hand",
        )]  # fmt: skip


def read_table_privileges(conn: Connection[Any], spec: OutboxSpec) -> TablePrivileges:
    """The old table's privileges from the catalog (`pg_class.relacl`, `pg_attribute.attacl`)."""
    rel = {"rel_reg": Names(spec).reg(spec.table)}
    rows = conn.execute(queries.query("privileges", "table-grants").compose(**rel)).fetchall()
    security = conn.execute(queries.query("privileges", "row-security").compose(**rel)).fetchone()
    return TablePrivileges(
        owner=str(rows[0][0]) if rows else "",
        grants=tuple(
            Grant(str(grantee), str(privilege), column, bool(grantable))
            for _owner, grantee, privilege, column, grantable in rows
            if grantee is not None
        ),
        row_security=bool(security and security[0]),
        policies=int(security[1]) if security else 0,
    )
