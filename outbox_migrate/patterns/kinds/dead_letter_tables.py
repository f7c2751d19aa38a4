"""The relay's dead-letter and attempts tables, created by the migration with the grants
dead-lettering needs, so a least-privilege relay (no CREATE in the schema) can dead-letter from
its first bad row. The DDL lives here; the relay creates the same tables when it may.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql

from outbox_migrate import sql as queries
from outbox_migrate.lock_budget import LockMode
from outbox_migrate.patterns import conditions as c
from outbox_migrate.patterns.kinds.base import BuildContext, kind
from outbox_migrate.patterns.model import CREATE_TIMEOUT_MS, Created, Lock, Step
from outbox_migrate.patterns.privileges import NO_PRIVILEGE, carry_privileges

DEAD_LETTER_TABLE = "outbox_dead_letter"
"""The relay's default dead-letter table (`relay --dead-letter-table`)."""
ATTEMPTS_TABLE_SUFFIX = "_attempts"
"""The attempts table is `<dead-letter table>_attempts`."""


def id_sql_type(text_ids: bool) -> sql.SQL:
    """How ids are stored in the attempts and dead-letter tables."""
    return sql.SQL("text" if text_ids else "int8")


def _create(
    columns: str, schema: str, table: str, text_ids: bool, if_not_exists: bool
) -> sql.Composed:
    return sql.SQL("{create} {table} (" + columns + ", PRIMARY KEY (source_table, id))").format(
        create=sql.SQL("CREATE TABLE IF NOT EXISTS" if if_not_exists else "CREATE TABLE"),
        table=sql.Identifier(schema, table),
        id_type=id_sql_type(text_ids),
    )


def create_dead_letter(
    schema: str, table: str, text_ids: bool = False, *, if_not_exists: bool = True
) -> sql.Composed:
    """Where messages go after failing `max_attempts` times; nothing is lost. A dead letter
    keeps what a replay needs (id, source, event type, key, payload, created_at and the broker
    headers as [name, value] pairs, in order) and what happened (attempts, every reason, how
    often the sink acknowledged it before: a failed mark follows a delivery). A payload that is
    not UTF-8 (bytea) is kept in `payload_bytes`, `payload` then holding its hex text."""
    columns = (
        "source_table text NOT NULL, id {id_type} NOT NULL, event_type text, message_key text, "
        "payload text NOT NULL, payload_bytes bytea, created_at timestamptz NOT NULL, "
        "attempts int NOT NULL, last_error text NOT NULL, "
        "dead_at timestamptz NOT NULL DEFAULT now(), headers jsonb, "
        "reasons text[] NOT NULL DEFAULT '{{}}', delivered int NOT NULL DEFAULT 0"
    )
    return _create(columns, schema, table, text_ids, if_not_exists)


def create_attempts(
    schema: str, table: str, text_ids: bool = False, *, if_not_exists: bool = True
) -> sql.Composed:
    """Failures so far of messages not yet published or dead-lettered: survives relay
    restarts, so a message that makes the relay crash-loop still reaches the dead letters.
    `reasons` keeps each failure's reason (the last few), `delivered` how many of them came
    after the sink had acknowledged the message (a failed mark)."""
    columns = (
        "source_table text NOT NULL, id {id_type} NOT NULL, attempts int NOT NULL, "
        "last_error text NOT NULL, updated_at timestamptz NOT NULL DEFAULT now(), "
        "reasons text[] NOT NULL DEFAULT '{{}}', delivered int NOT NULL DEFAULT 0"
    )
    return _create(columns, schema, table, text_ids, if_not_exists)


def _tables(params: Mapping[str, Any]) -> tuple[str, str]:
    dead = str(params.get("table", DEAD_LETTER_TABLE))
    return dead, dead + ATTEMPTS_TABLE_SUFFIX


@kind("create-dead-letter-tables")
def create_dead_letter_tables(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    """Plain CREATE TABLE: tables a relay made before the migration make the postcondition
    hold, and the step is adopted ("found": a rollback never drops them); tables this step
    created are dropped by its reverse, only while empty (dead letters are data)."""
    n = ctx.names
    dead, attempts = _tables(params)
    text_ids = n.spec.id_kind == "application"
    schema = n.spec.schema
    return Step(
        **ctx.place("create-dead-letter-tables"),
        summary=f"Create {dead} and {attempts}, the relay's dead letters",
        statements=(
            create_dead_letter(schema, dead, text_ids, if_not_exists=False),
            create_attempts(schema, attempts, text_ids, if_not_exists=False),
            carry_privileges(n, dead, NO_PRIVILEGE),
            carry_privileges(n, attempts, NO_PRIVILEGE),
        ),
        locks=(Lock(dead, LockMode.ACCESS_EXCLUSIVE), Lock(attempts, LockMode.ACCESS_EXCLUSIVE)),
        preconditions=(c.relation_exists(n, n.table),),
        postcondition=(c.relation_exists(n, dead), c.relation_exists(n, attempts)),
        reverse=(
            sql.SQL("DROP TABLE {}").format(n.q(attempts)),
            sql.SQL("DROP TABLE {}").format(n.q(dead)),
        ),
        reverse_note=f"drop {dead} and {attempts}; refused once either holds rows",
        reverse_preconditions=(c.relation_empty(n, dead), c.relation_empty(n, attempts)),
        statement_timeout_ms=CREATE_TIMEOUT_MS,
        creates=(Created("relation", dead), Created("relation", attempts)),
        notes=(
            f"Ids {'text' if text_ids else 'int8'}, as the relay binds them; owned by "
            f"{n.table}'s owner. Tables that exist already (a relay made them) are kept as "
            "they are, and never dropped by a rollback.",
        ),
    )


@kind("grant-dead-letters")
def grant_dead_letters(ctx: BuildContext, params: Mapping[str, Any]) -> Step:
    n = ctx.names
    dead, attempts = _tables(params)
    grants = dict(old_reg=n.reg(n.table), dead_reg=n.reg(dead), attempts_reg=n.reg(attempts),
                  unpublished_reg=n.reg(n.unpublished))  # fmt: skip
    return Step(
        **ctx.place("grant-dead-letters"),
        summary=f"Grant the relay's roles what dead-lettering needs on {dead}, {attempts} "
        f"and {n.unpublished}",
        statements=(queries.query("privileges", "grant-dead-letters").compose(**grants),),
        # GRANT only updates the relations' catalog rows: it takes no relation lock.
        locks=(),
        preconditions=(
            c.relation_exists(n, n.table),
            c.relation_exists(n, n.unpublished),
            c.relation_exists(n, dead),
            c.relation_exists(n, attempts),
        ),
        postcondition=(c.condition("dead-letter-grants", **grants),),
        reverse=(),
        reverse_note="kept: the grants go with the tables they are on",
        statement_timeout_ms=CREATE_TIMEOUT_MS,
        notes=(
            f"Every role with UPDATE on {n.table} (the relay's: it marks) gets SELECT, "
            f"INSERT, UPDATE, DELETE on both tables and DELETE on {n.unpublished}: a "
            "dead-lettered row leaves the outbox by DELETE, and one that cannot be marked "
            "(a duplicate id after the swap) has no other way out.",
        ),
    )
