"""Publication, slot, lag and decommissioning: plain SQL over a normal session.

Only the unpublished partition is published, inserts only, so a mark's move never reaches the
stream (docs/relay.md, "CDC mode").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from outbox_migrate.errors import RelayError, RunnerBusy
from outbox_migrate.sql import query

FAILOVER_MIN_VERSION = 170000


@dataclass(frozen=True)
class SlotState:
    """One row of pg_replication_slots, with the lag computed by the server."""

    name: str
    plugin: str | None
    database: str | None
    active: bool
    confirmed_lsn: str | None
    lag_bytes: int
    failover: bool


def ensure_publication(conn: Any, publication: str, schema: str, partition: str) -> None:
    """Create the publication on the unpublished partition. An existing one must publish
    exactly that table (else someone else's rows): checked, never altered."""
    rows = conn.execute(
        "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s",
        (publication,),
    ).fetchall()
    exists = conn.execute(
        "SELECT pubinsert FROM pg_publication WHERE pubname = %s", (publication,)
    ).fetchone()
    if exists is None:
        conn.execute(
            query("cdc", "create-publication").compose(
                publication=sql.Identifier(publication), table=sql.Identifier(schema, partition)
            )
        )
        return
    tables = {(str(r[0]), str(r[1])) for r in rows}
    if tables != {(schema, partition)} or not exists[0]:
        raise RelayError(
            f"publication {publication} exists but does not publish inserts of exactly "
            f"{schema}.{partition} (it has {sorted(tables) or 'no tables'}): drop it or name "
            "another with --publication"
        )


def slot_state(conn: Any, slot: str) -> SlotState | None:
    failover = "failover" if conn.info.server_version >= FAILOVER_MIN_VERSION else "false"
    row = conn.execute(
        query("cdc", "slot-state").compose(failover=sql.SQL(failover)), (slot,)
    ).fetchone()
    if row is None:
        return None
    return SlotState(str(row[0]), row[1], row[2], bool(row[3]), row[4], int(row[5]), bool(row[6]))


def check_database(state: SlotState, database: str, advice: str) -> None:
    """Slot names are server-wide: the slot of another database (the default `--slot` of a
    relay on a second outbox) belongs to someone else and is never dropped or streamed."""
    if state.database is None:
        raise RelayError(f"replication slot {state.name} is a physical slot: {advice}")
    if state.database != database:
        raise RelayError(
            f"replication slot {state.name} belongs to database {state.database}, not "
            f"{database}: {advice}"
        )


def check_owned(state: SlotState, database: str) -> None:
    """The relay's slot must be a pgoutput slot of `database` (see `check_database`)."""
    check_database(state, database, "give this relay its own --slot")
    if state.plugin != "pgoutput":
        raise RelayError(
            f"replication slot {state.name} uses plugin {state.plugin}, not pgoutput: give "
            "this relay its own --slot"
        )


STREAMED_ELSEWHERE_WAIT_S = 5.0
"""How long a start waits for the slot's last walsender to end: a relay stopped a moment ago
(or killed: the server notices its socket close) leaves it for well under a second."""


def wait_inactive(conn: Any, slot: str, wait_s: float = STREAMED_ELSEWHERE_WAIT_S) -> None:
    """Refuse (exit 3) a slot another relay streams from: one stream per slot. A second relay
    started anyway took the first's run record for an unclean stop, retried "slot is active"
    for ever, and on its way out removed the record of the run still going."""
    deadline = time.monotonic() + wait_s
    while True:
        state = slot_state(conn, slot)
        if state is None or not state.active:
            return
        if time.monotonic() >= deadline:
            raise RunnerBusy(
                f"replication slot {slot} is streamed by another process: one relay per "
                "slot; stop it, or give this relay its own --slot and --publication"
            )
        time.sleep(0.2)


def check_droppable(state: SlotState, database: str) -> None:
    """`--drop-slot` drops only what a relay could have made: a pgoutput slot of this
    database. Another plugin's slot (test_decoding, wal2json: another consumer's) or a
    physical one (a standby's) is refused before the question, with nothing dropped."""
    if state.database is None:
        raise RelayError(
            f"replication slot {state.name} is a physical slot (a standby's), never a "
            "relay's: nothing dropped"
        )
    check_database(state, database, "run --drop-slot against that database")
    if state.plugin != "pgoutput":
        raise RelayError(
            f"replication slot {state.name} uses plugin {state.plugin}, not pgoutput: another "
            "consumer's, not a relay's; nothing dropped"
        )


def active_relay_slots(conn: Any) -> list[str]:
    """The pgoutput slots of this database something streams from now."""
    rows = conn.execute(
        "SELECT slot_name FROM pg_replication_slots WHERE database = current_database() "
        "AND plugin = 'pgoutput' AND active ORDER BY slot_name"
    ).fetchall()
    return [str(row[0]) for row in rows]


def drop_slot(conn: Any, slot: str) -> bool:
    """Drop the slot if it exists, is a relay's of this database and nobody streams from it;
    True when dropped."""
    state = slot_state(conn, slot)
    if state is None:
        return False
    check_droppable(state, conn.info.dbname)
    if state.active:
        raise RelayError(f"replication slot {slot} is in use by a running relay: stop it first")
    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    return True


def drop_publication(conn: Any, publication: str) -> None:
    conn.execute(query("cdc", "drop-publication").compose(publication=sql.Identifier(publication)))


def check_replication(conn: Any) -> None:
    """The role may open a replication connection (REPLICATION, or a superuser): without it
    the stream's connection is refused at every try, which the relay took for an outage and
    retried for ever. Read from the catalog, so the check holds in any server language."""
    row = conn.execute(
        "SELECT rolreplication OR rolsuper, current_user FROM pg_roles WHERE rolname = current_user"
    ).fetchone()
    if row and not row[0]:
        role = sql.Identifier(str(row[1])).as_string(None)
        raise RelayError(
            f"--mode cdc streams through a replication connection, which role {row[1]} may not "
            f"open: ALTER ROLE {role} REPLICATION (docs/roles.md)"
        )


def check_wal_level(conn: Any) -> None:
    row = conn.execute("SHOW wal_level").fetchone()
    level = str(row[0]) if row else "?"
    if level != "logical":
        raise RelayError(
            f"--mode cdc needs wal_level = logical (the server has {level}): set it in "
            "postgresql.conf and restart the server"
        )
