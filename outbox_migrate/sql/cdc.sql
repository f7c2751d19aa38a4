-- The CDC relay's statements (relay/cdc/): its publication and slot on a normal session, its
-- marks behind the stream, the rows read back for the first start's backlog and the repair.
-- The replication protocol's commands (START_REPLICATION, CREATE_REPLICATION_SLOT) are not
-- SQL and stay with relay/cdc/stream.py.

-- name: create-publication
-- The publication of the unpublished partition's inserts only.
CREATE PUBLICATION {publication} FOR TABLE {table} WITH (publish = 'insert')

-- name: drop-publication
-- Decommissioning: the publication goes (the slot first).
DROP PUBLICATION IF EXISTS {publication}

-- name: comment-publication
-- The publication says which slot is ready to stream it.
COMMENT ON PUBLICATION {publication} IS {comment}

-- name: slot-state
-- One slot (param: its name), with its lag computed by the server, on a primary or a standby.
SELECT slot_name, plugin, database, active, confirmed_flush_lsn::text,
    coalesce(pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
        ELSE pg_current_wal_lsn() END, confirmed_flush_lsn), 0)::int8, {failover}
FROM pg_replication_slots WHERE slot_name = %s

-- name: begin-run
-- Record a run on a slot (param: its source label); more than one attempt: the last run died.
INSERT INTO {table} AS a (source_table, id, attempts, last_error)
VALUES (%s, 0, 1, 'a relay is running on this slot')
ON CONFLICT (source_table, id) DO UPDATE SET attempts = a.attempts + 1, updated_at = now()
RETURNING a.attempts

-- name: end-run
-- The run stopped cleanly (param: its source label).
DELETE FROM {table} WHERE source_table = %s AND id = 0

-- name: mark
-- Move acknowledged rows (param $1: their ids) to the published partition; the row count and
-- the snapshot the statement ran with.
WITH marked AS (
    UPDATE {table} SET {mark} WHERE {id} = ANY($1::int8[]) AND {unpublished}{same} RETURNING 1
)
SELECT count(*), pg_current_snapshot()::text FROM marked

-- name: rows-by-ids
-- The unpublished rows with these ids (param: int8[]) as text, in id order.
SELECT {columns} FROM {table} WHERE {id} = ANY(%s::int8[]) ORDER BY {id}

-- name: rows-by-ctids
-- The unpublished rows at these ctids (param: tid[]) as text.
SELECT ctid::text, {columns} FROM {table} WHERE ctid = ANY(%s::tid[])

-- name: backlog-ids
-- Every id of the unpublished partition, in order (read in the slot's exported snapshot).
SELECT {id} FROM {table} ORDER BY 1

-- name: repair-lock
-- The unpublished rows with these ids (param: ids): ctid and id, locked when {locking} is set.
SELECT ctid::text, {id} FROM {table} WHERE {id} = ANY(%(ids)s::int8[]){same}{locking}
