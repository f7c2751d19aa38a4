"""Find a migration by the names its outbox has after the rename to the original name.

The ledger keys a migration by the flat table's name (`table`). After the optional
`take-original-name` step, an operator may name the outbox as it now is: the view under the
partitioned table's former name (`--table outbox_new`), or the partitioned table under the
original name (`--partitioned-table outbox`, as its relays do). `status` and `verify` then
use the configuration the migration was recorded with, so they find it under either name.
Read-only: a SELECT on the ledger, nothing else.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from typing import Any

from psycopg import Connection

from outbox_migrate.config import OutboxSpec, Settings

_TUPLES = ("metadata_columns", "accept_lost_unique")


def recorded_settings(conn: Connection[Any], settings: Settings) -> Settings:
    """`settings` with the recorded spec of a renamed migration the given names point at;
    `settings` unchanged when a migration is recorded under `table` itself, or none matches."""
    spec = settings.spec
    row = conn.execute(
        "SELECT (SELECT m.spec::text FROM outbox_migrate.migration m "
        "        WHERE m.table_schema = %(schema)s AND m.state <> 'abandoned' "
        "          AND (m.spec->>'partitioned_table' = %(table)s OR m.table_name = %(parent)s) "
        "          AND EXISTS (SELECT 1 FROM outbox_migrate.step s WHERE s.migration_id = m.id "
        "                      AND s.kind = 'take-original-name' AND s.state = 'done') "
        "        ORDER BY m.id DESC LIMIT 1) "
        "WHERE NOT EXISTS (SELECT 1 FROM outbox_migrate.migration WHERE table_schema = "
        "%(schema)s AND table_name = %(table)s AND state <> 'abandoned')",
        {"schema": spec.schema, "table": spec.table, "parent": spec.partitioned_table},
    ).fetchone()
    if row is None or row[0] is None:
        return settings
    stored = json.loads(str(row[0]))
    known = {f.name for f in fields(OutboxSpec)}
    values: dict[str, Any] = {
        k: (tuple(v) if k in _TUPLES else v) for k, v in stored.items() if k in known
    }
    return replace(settings, spec=OutboxSpec(**values))
