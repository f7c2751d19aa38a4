"""Which objects a migration owns: recorded by OID when a step creates them, consulted before
anything is adopted or dropped (a name is not enough).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, LiteralString

from psycopg import Connection, sql

from outbox_migrate.config import OutboxSpec
from outbox_migrate.errors import PreconditionFailed
from outbox_migrate.patterns.model import Created, Step


@dataclass(frozen=True)
class Owner:
    migration_id: int
    pattern: str
    state: str
    origin: str


_OID_OF: dict[str, LiteralString] = {
    # %(own)s: the object's schema-qualified name; %(on)s: its relation's; %(name)s: its name
    "relation": "SELECT to_regclass(%(own)s)::oid::int8",
    "constraint": "SELECT oid::int8 FROM pg_constraint "
    "WHERE conrelid = to_regclass(%(on)s) AND conname = %(name)s",
    "trigger": "SELECT oid::int8 FROM pg_trigger "
    "WHERE tgrelid = to_regclass(%(on)s) AND tgname = %(name)s AND NOT tgisinternal",
    "publication-rel": "SELECT r.oid::int8 FROM pg_publication_rel r JOIN pg_publication p "
    "ON p.oid = r.prpubid WHERE p.pubname = %(name)s AND r.prrelid = to_regclass(%(on)s)",
    "function": "SELECT to_regprocedure(%(own)s || '()')::oid::int8",
}


def current_oid(conn: Connection[Any], spec: OutboxSpec, obj: Created) -> int | None:
    if obj.kind not in _OID_OF:
        raise ValueError(f"unknown object kind {obj.kind!r}")
    names = {"own": obj.name, "on": obj.on or obj.name}
    params = {key: sql.Identifier(spec.schema, n).as_string(None) for key, n in names.items()}
    row = conn.execute(_OID_OF[obj.kind], {**params, "name": obj.name}).fetchone()
    return int(row[0]) if row and row[0] is not None else None


def owners(conn: Connection[Any], kind: str, oid: int) -> list[Owner]:
    rows = conn.execute(
        "SELECT o.migration_id, m.pattern, m.state, o.origin FROM outbox_migrate.owned_object o "
        "JOIN outbox_migrate.migration m ON m.id = o.migration_id "
        "WHERE o.kind = %s AND o.object_oid = %s ORDER BY o.migration_id",
        (kind, oid),
    ).fetchall()
    return [Owner(int(r[0]), str(r[1]), str(r[2]), str(r[3])) for r in rows]


@dataclass(frozen=True)
class RelationOwner:
    migration_id: int
    pattern: str
    state: str
    table: str
    """The owning migration's table, schema-qualified."""


def relation_owner(conn: Connection[Any], spec: OutboxSpec, relation: str) -> RelationOwner | None:
    """The live (active or completed) migration that created or took over the relation
    `relation` of the table's schema, by OID; None when none did (or it does not exist)."""
    row = conn.execute(
        "SELECT m.id, m.pattern, m.state, m.table_schema || '.' || m.table_name "
        "FROM outbox_migrate.owned_object o JOIN outbox_migrate.migration m "
        "ON m.id = o.migration_id WHERE o.kind = 'relation' "
        "AND o.object_oid = to_regclass(%s) AND m.state <> 'abandoned' ORDER BY m.id LIMIT 1",
        (sql.Identifier(spec.schema, relation).as_string(None),),
    ).fetchone()
    return RelationOwner(int(row[0]), str(row[1]), str(row[2]), str(row[3])) if row else None


def record(
    conn: Connection[Any],
    migration_id: int,
    step: Step,
    spec: OutboxSpec,
    origin: str,
    objects: tuple[Created, ...] | None = None,
) -> None:
    """Record the step's objects (or `objects`, e.g. what its inverse re-created) under this
    migration, inside the step's transaction so the record commits with the DDL."""
    for obj in step.creates if objects is None else objects:
        oid = current_oid(conn, spec, obj)
        if oid is None:
            continue
        conn.execute(
            "INSERT INTO outbox_migrate.owned_object "
            "(migration_id, step_id, kind, object_oid, name, origin) "
            "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (migration_id, kind, object_oid) "
            "DO NOTHING",
            (migration_id, step.id, obj.kind, oid, obj.name, origin),
        )


def check_adoptable(conn: Connection[Any], migration_id: int, step: Step, spec: OutboxSpec) -> str:
    """Refuse to adopt an object another live migration owns; say how it may be taken.

    Returns the origin to record: `created` (already ours), `adopted` (made by an abandoned
    migration of this tool, handed over) or `found` (no ledger knows it: made by hand or by
    offline SQL; it is adopted but a rollback will never drop it).
    """
    origin = "found"
    for obj in step.creates:
        oid = current_oid(conn, spec, obj)
        if oid is None:
            continue
        for owner in owners(conn, obj.kind, oid):
            if owner.migration_id == migration_id:
                return owner.origin
            if owner.state in ("active", "completed"):
                raise PreconditionFailed(
                    step.id,
                    "owned-by-another-migration",
                    f"{obj.name} belongs to the {owner.pattern.upper()} migration "
                    f"#{owner.migration_id} ({owner.state}); finish or roll back that "
                    "migration instead of starting another on the same objects",
                )
            origin = "adopted"
    return origin


def check_droppable(
    conn: Connection[Any], migration_id: int | None, step: Step, spec: OutboxSpec
) -> None:
    """Before a step's inverse drops its objects (called under the step's locks): each must
    be one this migration created or took over, with the same OID as recorded."""
    for obj in step.creates:
        oid = current_oid(conn, spec, obj)
        if oid is None:
            continue  # already gone: the inverse's IF EXISTS / DROP finds nothing to lose
        mine = [
            o
            for o in (owners(conn, obj.kind, oid) if migration_id is not None else [])
            if o.migration_id == migration_id
        ]
        if not mine or mine[0].origin == "found":
            why = (
                "it was there before this migration (made by hand or by offline SQL)"
                if mine
                else "this migration did not create it"
            )
            raise PreconditionFailed(
                f"{step.id} (reverse)",
                "owned-by-this-migration",
                f"{obj.name} is not dropped: {why}; drop it yourself if that is intended",
            )
