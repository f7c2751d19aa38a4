"""Every identifier a step needs, composed once from the `OutboxSpec` with `psycopg.sql`: `q`
(an Identifier for SQL text) and `reg` (a text literal of the quoted name, for `to_regclass`).
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from outbox_migrate.config import OutboxSpec

GATE_LOCK_NAMESPACE = "outbox-migrate.gate"
"""First key of the writers' shared advisory lock (kinds/gate_sequence.py); the second is the
old table's name. Here, below both the kind that takes the lock and the conditions that look
for it (sql/conditions.sql's `key1`, `key2`), so neither imports the other."""


def gate_lock_keys(n: Names) -> tuple[sql.Composable, sql.Composable]:
    """The two int4 keys of the writers' advisory lock, as SQL expressions."""
    return (
        sql.SQL("hashtext({})").format(sql.Literal(GATE_LOCK_NAMESPACE)),
        sql.SQL("hashtext({})").format(n.reg(n.table)),
    )


@dataclass(frozen=True)
class Names:
    spec: OutboxSpec

    def q(self, relation: str) -> sql.Identifier:
        return sql.Identifier(self.spec.schema, relation)

    def reg(self, relation: str) -> sql.Literal:
        return sql.Literal(ident(self.spec.schema, relation))

    def display(self, relation: str) -> str:
        """Human form, in lock tables and messages: schema-qualified only outside `public`."""
        if self.spec.schema == "public":
            return relation
        return f"{self.spec.schema}.{relation}"

    @property
    def table(self) -> str:
        return self.spec.table

    @property
    def parent(self) -> str:
        return self.spec.partitioned_table

    @property
    def unpublished(self) -> str:
        return self.spec.unpublished_partition

    @property
    def published(self) -> str:
        return self.spec.published_partition

    @property
    def id_q(self) -> sql.Identifier:
        return sql.Identifier(self.spec.id_column)

    @property
    def published_at_q(self) -> sql.Identifier:
        return sql.Identifier(self.spec.published_column)

    @property
    def check_q(self) -> sql.Identifier:
        return sql.Identifier(self.spec.check_name)

    def id_sequence(self, relation: str) -> sql.Composed:
        """The sequence that hands out `relation`'s ids, as a regclass (NULL when none).

        `pg_get_serial_sequence` finds identity sequences and serial sequences OWNED BY the
        column; a `DEFAULT nextval('some_seq')` on a sequence the column does not own is found
        through the default's dependency on it, so the deploy gates watch that one too.
        """
        return sql.SQL(
            "coalesce(pg_get_serial_sequence({rel}, {col})::regclass, ("
            "SELECT d.refobjid::regclass FROM pg_attrdef ad "
            "JOIN pg_attribute a ON a.attrelid = ad.adrelid AND a.attnum = ad.adnum "
            "JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid "
            "AND d.refclassid = 'pg_class'::regclass "
            "JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S' "
            "WHERE ad.adrelid = to_regclass({rel}) AND a.attname = {col} LIMIT 1))"
        ).format(rel=self.reg(relation), col=sql.Literal(self.spec.id_column))


def ident(*parts: str) -> str:
    """An identifier as SQL text (`"Sales"."OutboxData"`), always quoted by psycopg, so a fix
    copied from `plan` runs on mixed-case names, on names that are keywords (`"offset"`) and in
    any schema, whatever the reader's search_path."""
    return sql.Identifier(*parts).as_string(None)


def literal(value: str) -> str:
    """A string literal as SQL text (a regclass name inside `setval('…')`, say)."""
    return sql.Literal(value).as_string(None)
