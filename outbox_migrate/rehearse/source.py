"""What `rehearse` reads from the live database: the outbox's shape and how busy it is. Only
reads: every session runs with `default_transaction_read_only=on`, so PostgreSQL itself
refuses a write."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from outbox_migrate.advisory.introspect import TableFacts, introspect
from outbox_migrate.config import OutboxSpec


@dataclass(frozen=True)
class Rates:
    """Rows per second in the statistics views over `measured_over_s` (the report's names)."""

    measured_over_s: float
    inserts_per_s: float
    updates_per_s: float
    deletes_per_s: float


@dataclass
class SourceShape:
    """The live table as the scratch copy must reproduce it."""

    facts: TableFacts
    enums: dict[str, list[str]] = field(default_factory=dict)
    """Enum types the columns use: qualified name → labels in order."""
    sequences: list[str] = field(default_factory=list)
    """Sequences named by column defaults (`nextval('…')`), qualified and quoted."""
    grants: list[tuple[str, str]] = field(default_factory=list)
    """(grantee, privilege) on the table, owner excluded."""
    trigger_functions: list[str] = field(default_factory=list)
    """`CREATE FUNCTION` text of every function the table's triggers call."""


def read_only_connect(dsn: str) -> psycopg.Connection[Any]:
    """An autocommit session that cannot write (libpq `options`: the server refuses any write)
    and holds no snapshot (each statement its own short transaction: statistics are re-read
    every time)."""
    return psycopg.connect(
        dsn, autocommit=True, options="-c default_transaction_read_only=on",
        application_name="outbox-migrate rehearse",
    )  # fmt: skip


def read_shape(dsn: str, spec: OutboxSpec, pattern: str) -> SourceShape:
    with read_only_connect(dsn) as conn:
        facts = introspect(conn, spec, pattern)
        table = sql.Identifier(spec.schema, spec.table).as_string(conn)
        shape = SourceShape(facts)
        for name, labels in conn.execute(
            "SELECT t.oid::regtype::text, array_agg(e.enumlabel ORDER BY e.enumsortorder) "
            "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
            "JOIN pg_enum e ON e.enumtypid = t.oid "
            "WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped "
            "GROUP BY 1",
            (table,),
        ):
            shape.enums[str(name)] = list(labels)
        shape.sequences = [
            str(sequence)
            for (sequence,) in conn.execute(
                "SELECT DISTINCT d.refobjid::regclass::text FROM pg_depend d "
                "JOIN pg_attrdef ad ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid "
                "JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S' "
                "WHERE ad.adrelid = to_regclass(%s)",
                (table,),
            )
        ]
        shape.grants = [
            (str(grantee), str(privilege))
            for grantee, privilege in conn.execute(
                "SELECT coalesce(r.rolname, 'PUBLIC'), a.privilege_type "
                "FROM pg_class c, aclexplode(c.relacl) a "
                "LEFT JOIN pg_roles r ON r.oid = a.grantee "
                "WHERE c.oid = to_regclass(%s) AND a.grantee <> c.relowner ORDER BY 1, 2",
                (table,),
            )
        ]
        shape.trigger_functions = [
            str(row[0])
            for row in conn.execute(
                "SELECT DISTINCT pg_get_functiondef(t.tgfoid) FROM pg_trigger t "
                "WHERE t.tgrelid = to_regclass(%s) AND NOT t.tgisinternal",
                (table,),
            )
        ]
    return shape


def measure_rates(dsn: str, spec: OutboxSpec, seconds: float) -> Rates:
    """Inserts, updates and deletes per second from `pg_stat_user_tables` over `seconds`: a
    backend flushes its counters within about a second of a commit, so a steady figure needs
    a few seconds; each read is its own transaction, so the view's snapshot is fresh."""
    query = (
        "SELECT coalesce(n_tup_ins, 0), coalesce(n_tup_upd, 0), coalesce(n_tup_del, 0) "
        "FROM pg_stat_user_tables WHERE relid = to_regclass(%s)"
    )
    with read_only_connect(dsn) as conn:
        table = sql.Identifier(spec.schema, spec.table).as_string(conn)
        first = conn.execute(query, (table,)).fetchone() or (0, 0, 0)
        started = time.monotonic()
        time.sleep(seconds)
        last = conn.execute(query, (table,)).fetchone() or (0, 0, 0)
        span = max(time.monotonic() - started, 1e-6)
    ins, upd, dele = (max(int(b) - int(a), 0) / span for a, b in zip(first, last, strict=True))
    return Rates(round(span, 1), round(ins, 1), round(upd, 1), round(dele, 1))
