"""The wake-up trigger: the partitioned outbox wakes an idle relay without application changes.

Inert SQL, install and inspection only; why it notifies only while a relay is idle is in
docs/relay.md ("Wake-ups").
"""

from __future__ import annotations

import zlib
from typing import Any

from psycopg import sql

from outbox_migrate.config import MAX_IDENTIFIER_BYTES, OutboxSpec

ADVISORY_NAMESPACE = "outbox-migrate.relay"
"""The relay's advisory-lock namespace (its shard and idle locks). Here, below the relay,
because the wake-up trigger this module writes takes the idle lock by a key derived from it."""

TRIGGER_NAME = "relay_notify"
NEW_ROWS = "new_rows"
"""Transition table name inside the trigger function."""


def function_name(spec: OutboxSpec) -> str:
    """`<partitioned table>_relay_notify`, cut to PostgreSQL's identifier length."""
    suffix = "_relay_notify"
    return spec.partitioned_table[: MAX_IDENTIFIER_BYTES - len(suffix)] + suffix


def idle_lock_key(label: str) -> int:
    """The idle lock's first key for the table `label` (= schema.table), as a signed int4.

    Computed here to be a literal in the trigger: hashing the name on every INSERT was most of
    its cost (bench/README.md, trigger_parts.py). A renamed table needs the trigger reinstalled
    (`relay --install-notify`); `key_matches` lets the relay warn."""
    key = f"{ADVISORY_NAMESPACE}:{label}:idle"
    return int.from_bytes(zlib.crc32(key.encode()).to_bytes(4, "big"), signed=True)


def label(spec: OutboxSpec) -> str:
    """The partitioned outbox's label, as the relay names its source (relay/queries.py)."""
    return f"{spec.schema}.{spec.partitioned_table}"


def create_sql(
    spec: OutboxSpec, channel: str, *, key_spec: OutboxSpec | None = None
) -> tuple[sql.Composed, ...]:
    """The trigger function and the statement-level trigger on the partitioned parent.

    `key_spec`: the names whose idle lock key the function uses, when they differ from the
    ones it is installed under (the rename to the original name re-keys the function in
    place, so relays started with the new name are woken)."""
    function = sql.Identifier(spec.schema, function_name(spec))
    # The function's comment names this module by its former path on purpose: the text is
    # part of the step's checksum, which a migration under way has recorded.
    body = sql.SQL(
        "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $om$\n"
        "BEGIN\n"
        "    -- an idle relay holds this lock exclusively: only then is a NOTIFY worth its\n"
        "    -- commit-time cost; the key stands for this table's name (idle_lock_key in\n"
        "    -- outbox_migrate/relay/notify.py)\n"
        "    IF NOT {key} THEN\n"
        "        PERFORM pg_notify(TG_ARGV[0], {payload});\n"
        "    END IF;\n"
        "    RETURN NULL;\n"
        "END\n"
        "$om$"
    ).format(
        function=function,
        key=sql.SQL(_lock_call(key_spec or spec)),
        payload=_payload(spec),
    )
    trigger = sql.SQL(
        "CREATE TRIGGER {trigger} AFTER INSERT ON {parent} REFERENCING NEW TABLE AS {new_rows} "
        "FOR EACH STATEMENT EXECUTE FUNCTION {function}({channel})"
    ).format(
        trigger=sql.Identifier(TRIGGER_NAME),
        parent=sql.Identifier(spec.schema, spec.partitioned_table),
        new_rows=sql.Identifier(NEW_ROWS),
        function=function,
        channel=sql.Literal(channel),
    )
    return (body, trigger)


def _payload(spec: OutboxSpec) -> sql.Composable:
    """The statement's lowest id; application-supplied ids (uuid, ULID) have no useful order
    for the cursor (and uuid has no min()), so those notify with an empty payload."""
    if spec.id_kind == "application":
        return sql.Literal("")
    return sql.SQL("(SELECT min({id})::text FROM {new_rows})").format(
        id=sql.Identifier(spec.id_column), new_rows=sql.Identifier(NEW_ROWS)
    )


def drop_sql(spec: OutboxSpec) -> tuple[sql.Composed, ...]:
    return (
        sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(
            sql.Identifier(TRIGGER_NAME), sql.Identifier(spec.schema, spec.partitioned_table)
        ),
        sql.SQL("DROP FUNCTION IF EXISTS {}()").format(
            sql.Identifier(spec.schema, function_name(spec))
        ),
    )


def install(conn: Any, spec: OutboxSpec, channel: str) -> None:
    """Install (or replace) the trigger on an existing partitioned outbox, in one transaction.
    CREATE TRIGGER makes inserts wait: a short lock_timeout keeps them from queueing behind
    a long transaction and us."""
    import psycopg

    from outbox_migrate.errors import RelayError

    try:
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '2s'")
            for statement in (drop_sql(spec)[0], *create_sql(spec, channel)):
                conn.execute(statement)
    except psycopg.errors.UndefinedTable as exc:
        raise RelayError(
            f"cannot install the wake-up trigger: {spec.schema}.{spec.partitioned_table} "
            "does not exist"
        ) from exc
    except psycopg.errors.LockNotAvailable as exc:
        raise RelayError(
            f"cannot install the wake-up trigger: {spec.schema}.{spec.partitioned_table} "
            "stayed locked for 2 s (a long transaction?); try again"
        ) from exc


def installed(conn: Any, spec: OutboxSpec) -> bool:
    row = conn.execute(
        "SELECT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND tgname = %s)",
        (sql.Identifier(spec.schema, spec.partitioned_table).as_string(conn), TRIGGER_NAME),
    ).fetchone()
    return bool(row and row[0])


def key_matches(conn: Any, spec: OutboxSpec) -> bool | None:
    """Whether the installed trigger function uses this relay's idle lock key (None: no
    trigger function installed). False after a rename of the table without reinstalling."""
    row = conn.execute(
        "SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure(%s)",
        (sql.Identifier(spec.schema, function_name(spec)).as_string(conn) + "()",),
    ).fetchone()
    if row is None:
        return None
    return _lock_call(spec) in str(row[0])


def _lock_call(spec: OutboxSpec) -> str:
    """The trigger's lock call (an int rendered by Python: digits and a sign, nothing to quote)."""
    return f"pg_try_advisory_xact_lock_shared({idle_lock_key(label(spec))}, 0)"
