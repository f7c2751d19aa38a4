"""How bloated a btree index is: measured with pgstattuple, or estimated from statistics
(docs/maintenance.md). Read-only: `reindex` decides what to do about it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg import sql

from outbox_migrate.errors import UsageError

BTREE_DEFAULT_FILLFACTOR_PCT = 90
PAGE_HEADER_BYTES = 24
"""PageHeaderData."""
BTREE_SPECIAL_BYTES = 16
"""BTPageOpaqueData at the end of every btree page."""
INDEX_TUPLE_HEADER_BYTES = 8
"""IndexTupleData: heap TID (6) + t_info (2)."""
LINE_POINTER_BYTES = 4
"""ItemIdData per entry."""
MAXALIGN_BYTES = 8

Method = Literal["pgstattuple", "estimate"]


@dataclass(frozen=True)
class IndexBloat:
    index: str
    table: str
    size_bytes: int
    expected_bytes: int
    """Size a fresh build would have at the index's fillfactor."""
    bloat_pct: float
    method: Method
    trustworthy: bool
    """False when the estimate lacks statistics (never analyzed, expression columns)."""
    detail: dict[str, float]


def _maxalign(n: float) -> float:
    return math.ceil(n / MAXALIGN_BYTES) * MAXALIGN_BYTES


def _bloat(
    facts: dict[str, Any],
    size_bytes: int,
    expected_pages: int,
    method: Method,
    trustworthy: bool,
    detail: dict[str, float],
) -> IndexBloat:
    """The index's real size against the `expected_pages` a fresh build needs."""
    block = int(facts["block_size"])
    size_pages = size_bytes // block
    share = max(0, size_pages - expected_pages) / size_pages if size_pages > 0 else 0.0
    return IndexBloat(
        str(facts["index"]), str(facts["table"]), int(facts["size_bytes"]),
        expected_pages * block, round(100.0 * share, 2), method, trustworthy, detail,
    )  # fmt: skip


def pgstattuple_schema(conn: psycopg.Connection[Any], *, create: bool) -> str | None:
    """Schema of the pgstattuple extension, creating it when allowed; None when unavailable."""
    row = conn.execute(
        "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace"
        " WHERE e.extname = 'pgstattuple'"
    ).fetchone()
    if row:
        return str(row[0])
    if not create:
        return None
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
    except psycopg.Error:
        # Not installed on the server, or we may not create extensions: fall back to the
        # estimate. Autocommit means the failed statement left no aborted transaction.
        return None
    return pgstattuple_schema(conn, create=False)


def _index_facts(conn: psycopg.Connection[Any], index_oid: int) -> dict[str, Any]:
    cur = conn.execute(
        "SELECT ic.relname AS index, tn.nspname || '.' || tc.relname AS table,"
        " tc.oid::int8 AS table_oid, pg_relation_size(ic.oid) AS size_bytes,"
        " current_setting('block_size')::int AS block_size, tc.reltuples::float8 AS reltuples,"
        " coalesce((SELECT split_part(o, '=', 2)::int FROM unnest(ic.reloptions) o"
        "   WHERE o LIKE 'fillfactor=%%'), %s) AS fillfactor"
        " FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid"
        " JOIN pg_class tc ON tc.oid = i.indrelid JOIN pg_namespace tn ON tn.oid = tc.relnamespace"
        " WHERE i.indexrelid = %s",
        (BTREE_DEFAULT_FILLFACTOR_PCT, index_oid),
    )
    row = cur.fetchone()
    if row is None:
        raise UsageError(f"no index with oid {index_oid}")
    return dict(zip([d.name for d in cur.description or []], row, strict=True))


def measure_pgstattuple(
    conn: psycopg.Connection[Any], index_oid: int, extension_schema: str
) -> IndexBloat:
    """Exact physical picture: live leaf bytes repacked at the fillfactor vs the real size."""
    facts = _index_facts(conn, index_oid)
    cur = conn.execute(
        sql.SQL(
            "SELECT tree_level, index_size, internal_pages, leaf_pages, empty_pages,"
            " deleted_pages, avg_leaf_density FROM {}.pgstatindex(%s::oid::regclass)"
        ).format(sql.Identifier(extension_schema)),
        (index_oid,),
    )
    row = cur.fetchone()
    assert row is not None
    stats = dict(zip([d.name for d in cur.description or []], row, strict=True))
    block = int(facts["block_size"])
    density = float(stats["avg_leaf_density"])
    if math.isnan(density):
        density = 0.0
    leaf_pages = int(stats["leaf_pages"])
    live_leaf_bytes = leaf_pages * block * density / 100.0
    fill = int(facts["fillfactor"]) / 100.0
    expected_leaf = math.ceil(live_leaf_bytes / (block * fill)) if live_leaf_bytes else 0
    # Internal levels shrink in proportion to the leaves; the metapage is always there.
    internal = int(stats["internal_pages"])
    expected_internal = math.ceil(internal * expected_leaf / leaf_pages) if leaf_pages else 0
    expected_pages = 1 + max(1, expected_leaf) + expected_internal
    return _bloat(facts, int(stats["index_size"]), expected_pages, "pgstattuple", True, {
        "leaf_pages": leaf_pages,
        "deleted_pages": int(stats["deleted_pages"]),
        "empty_pages": int(stats["empty_pages"]),
        "avg_leaf_density_pct": density,
    })  # fmt: skip


def measure_estimate(conn: psycopg.Connection[Any], index_oid: int) -> IndexBloat:
    """Statistics-based estimate: `reltuples` entries of the `pg_stats` width, packed."""
    facts = _index_facts(conn, index_oid)
    rows = conn.execute(
        "SELECT k.attnum, a.attname, s.avg_width, s.null_frac, t.typlen"
        " FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)"
        " LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
        " LEFT JOIN pg_type t ON t.oid = a.atttypid"
        " LEFT JOIN pg_class c ON c.oid = i.indrelid"
        " LEFT JOIN pg_namespace n ON n.oid = c.relnamespace"
        " LEFT JOIN pg_stats s ON s.schemaname = n.nspname AND s.tablename = c.relname"
        "   AND s.attname = a.attname"
        " WHERE i.indexrelid = %s ORDER BY k.n",
        (index_oid,),
    ).fetchall()
    trustworthy = float(facts["reltuples"]) >= 0
    width = 0.0
    has_nulls = False
    for attnum, _name, avg_width, null_frac, typlen in rows:
        if int(attnum) == 0:  # an expression column: no width to go by
            trustworthy = False
            width += 8
            continue
        if avg_width is None:
            # No statistics yet: a fixed-width type still tells its width.
            width += float(typlen) if typlen and int(typlen) > 0 else 8.0
            trustworthy = trustworthy and bool(typlen and int(typlen) > 0)
            continue
        width += float(avg_width) * (1.0 - float(null_frac or 0.0))
        has_nulls = has_nulls or bool(null_frac)
    header = INDEX_TUPLE_HEADER_BYTES + (MAXALIGN_BYTES if has_nulls else 0)
    entry_bytes = _maxalign(header + width) + LINE_POINTER_BYTES
    block = int(facts["block_size"])
    usable = block - PAGE_HEADER_BYTES - BTREE_SPECIAL_BYTES
    per_leaf = max(1, int(usable * int(facts["fillfactor"]) / 100.0 // entry_bytes))
    tuples = max(0.0, float(facts["reltuples"]))
    leaf = max(1, math.ceil(tuples / per_leaf))
    # Internal pages hold one downlink per child; they are packed at 70 % by btree.
    per_internal = max(2, int(usable * 0.7 // entry_bytes))
    internal = 0
    level = leaf
    while level > 1:
        level = math.ceil(level / per_internal)
        internal += level
    expected_pages = 1 + leaf + internal
    detail = {"reltuples": tuples, "entry_bytes": entry_bytes, "entries_per_leaf": per_leaf}
    return _bloat(facts, int(facts["size_bytes"]), expected_pages, "estimate", trustworthy, detail)


def measure(
    conn: psycopg.Connection[Any],
    index_oid: int,
    method: Literal["auto", "pgstattuple", "estimate"] = "auto",
) -> IndexBloat:
    """`auto`: pgstattuple when it exists or can be created and this role may call it, else
    the estimate."""
    if method != "estimate":
        schema = pgstattuple_schema(conn, create=True)
        if schema is not None and _may_call_pgstatindex(conn, schema):
            return measure_pgstattuple(conn, index_oid, schema)
        if method == "pgstattuple":
            raise UsageError(
                "pgstattuple is not available and cannot be created"
                if schema is None
                else f"pgstattuple: role {conn.info.user} may not call pgstatindex (GRANT "
                "pg_stat_scan_tables to it, or use --bloat-method estimate)"
            )
    return measure_estimate(conn, index_oid)


def _may_call_pgstatindex(conn: psycopg.Connection[Any], schema: str) -> bool:
    """The extension's functions are revoked from PUBLIC (granted to pg_stat_scan_tables): a
    role that is not the owner meets "permission denied" where the estimate would do."""
    signature = sql.SQL("{}.pgstatindex(regclass)").format(sql.Identifier(schema))
    row = conn.execute(
        "SELECT has_function_privilege(%s, 'EXECUTE')", (signature.as_string(conn),)
    ).fetchone()
    return bool(row and row[0])
