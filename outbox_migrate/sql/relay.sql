-- The relay's statements on its attempts and dead-letter tables, shared by both delivery styles
-- (relay/bad_rows.py composes them, relay/dead_letters.py runs the operator's commands).
-- {table}: the attempts or dead-letter table; {id_type}: int8 or text (application ids);
-- {history}: the reasons and deliveries columns, or stand-ins for a table of an earlier version.

-- name: columns-of
-- Each column of a table and its type as format_type spells it.
SELECT attname::text, format_type(atttypid, atttypmod) FROM pg_attribute
WHERE attrelid = {reg}::regclass AND attnum > 0 AND NOT attisdropped

-- name: attempted
-- Counters on record (param: source): id, attempts, last error, reasons, deliveries.
SELECT id, attempts, last_error, {history} FROM {table} WHERE source_table = %(source)s

-- name: attempts-of
-- The counters of some ids (params: source, ids), as attempted.
SELECT id, attempts, last_error, {history} FROM {table}
WHERE source_table = %(source)s AND id = ANY(%(ids)s::{id_type}[])

-- name: count-attempts
-- One failure more per id (params: source, ids, errors, delivered), with its reasons kept.
INSERT INTO {table} AS a (source_table, id, attempts, last_error, reasons, delivered)
SELECT %(source)s, r.id, 1, r.error, ARRAY[r.error], %(delivered)s
FROM unnest(%(ids)s::{id_type}[], %(errors)s::text[]) AS r(id, error)
ON CONFLICT (source_table, id) DO UPDATE SET attempts = a.attempts + 1,
    last_error = excluded.last_error, updated_at = now(),
    reasons = (a.reasons || excluded.reasons)[greatest(1, cardinality(a.reasons) + 2 - {kept}):],
    delivered = a.delivered + excluded.delivered
RETURNING a.id, a.attempts, a.reasons, a.delivered

-- name: count-attempts-without-history
-- count-attempts on an attempts table of an earlier version (no reasons, no deliveries).
INSERT INTO {table} AS a (source_table, id, attempts, last_error)
SELECT %(source)s, r.id, 1, r.error
FROM unnest(%(ids)s::{id_type}[], %(errors)s::text[]) AS r(id, error)
ON CONFLICT (source_table, id) DO UPDATE SET attempts = a.attempts + 1,
    last_error = excluded.last_error, updated_at = now()
RETURNING a.id, a.attempts, NULL::text[], 0

-- name: note-attempts
-- The reason of attempts counted beforehand (params: source, ids, errors).
UPDATE {table} AS a SET last_error = r.error, updated_at = now(){reasons}
FROM unnest(%(ids)s::{id_type}[], %(errors)s::text[]) AS r(id, error)
WHERE a.source_table = %(source)s AND a.id = r.id
RETURNING a.id, a.attempts, {history}

-- name: uncount-attempts
-- One attempt per id taken back (params: source, ids).
UPDATE {table} SET attempts = attempts - 1 WHERE source_table = %(source)s
AND id = ANY(%(ids)s::{id_type}[]) RETURNING id, attempts

-- name: forget-attempts
-- The counters of ids published or dead-lettered (params: source, ids).
DELETE FROM {table} WHERE source_table = %(source)s AND id = ANY(%(ids)s::{id_type}[])

-- name: insert-dead-letter
-- Keep one message; a row comes back only when it was written.
INSERT INTO {table} (source_table, id, event_type, message_key, payload,
    created_at, attempts, last_error{columns})
VALUES (%(source)s, %(id)s, %(event_type)s, %(key)s, %(payload)s, %(created_at)s,
    %(attempts)s, %(error)s{values})
ON CONFLICT (source_table, id) DO NOTHING RETURNING true

-- name: dead-letters-of
-- The dead letters of one id and its copies, each with whether it holds exactly this message.
SELECT source_table, event_type IS NOT DISTINCT FROM %(event_type)s
    AND message_key IS NOT DISTINCT FROM %(key)s AND payload::text = %(payload)s::text
    AND created_at = %(created_at)s
FROM {table} WHERE id = %(id)s
AND (source_table = %(source)s OR starts_with(source_table, %(copies)s))

-- name: list-dead-letters
-- The selected dead letters, oldest message first.
SELECT {columns} FROM {table} d WHERE {where} ORDER BY d.created_at, d.id::text LIMIT {limit}

-- name: purge-dead-letters
-- Delete the selected dead letters for good.
DELETE FROM {table} d WHERE {where} RETURNING d.id::text

-- name: lock-dead-letters
-- The selected dead letters, oldest first, locked (none another session holds).
SELECT d.source_table, d.id::text FROM {table} d WHERE {where}
ORDER BY d.created_at, d.id::text FOR UPDATE SKIP LOCKED

-- name: drop-dead-letter
-- One requeued message's row in a dead-letter or attempts table (params: source, id).
DELETE FROM {table} WHERE source_table = %(source)s AND id::text = %(id)s

-- name: requeue-columns
-- The target's columns, their types, and '+' after those with a default or an identity.
SELECT a.attname::text, format_type(a.atttypid, a.atttypmod)
    || CASE WHEN a.attidentity <> '' OR a.atthasdef THEN '+' ELSE '' END
FROM pg_attribute a WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped

-- name: requeue
-- One dead letter (params: source, id) back into its table as an unpublished row.
INSERT INTO {target} ({columns}){overriding} SELECT {values} FROM {table} d
WHERE d.source_table = %(source)s AND d.id::text = %(id)s RETURNING {id}::text


-- The polling relay's statements with nothing composed into them (relay/queries.py names them
-- and says why each is shaped so; the claim, the mark and the other statements built from the
-- names in force stay there).

-- name: horizon
-- The transaction horizon as integers: the oldest xid still running, the first not assigned.
SELECT pg_snapshot_xmin(s)::text::bigint, pg_snapshot_xmax(s)::text::bigint
FROM pg_current_snapshot() s

-- name: try-idle-lock
-- Raise the idle flag the wake-up trigger looks at (param: key); a try, never a wait.
SELECT pg_try_advisory_lock(%(key)s::int, 0)

-- name: idle-unlock
-- Lower the idle flag: writers stop notifying (the relay is claiming anyway).
SELECT pg_advisory_unlock(%(key)s::int, 0)

-- name: claim-session-settings
-- Settings of a claiming session: walk the id index, never scan-and-sort.
SET enable_sort = off

-- name: try-lock-shards
-- Session advisory locks on up to %(limit)s free shards, in the order given; no ORDER BY, so
-- no lock beyond the limit.
SELECT s FROM unnest(%(shards)s::int[]) AS s
WHERE pg_try_advisory_lock(hashtext(%(key)s), s) LIMIT %(limit)s

-- name: unlock-shards
-- Give shards back.
SELECT pg_advisory_unlock(hashtext(%(key)s), s) FROM unnest(%(shards)s::int[]) AS s

-- name: end-idle-shard-holders
-- End the shard holders silent for longer than %(after_s)s seconds: pid, silence, ended.
-- Silent: idle, idle in transaction, or `active` in ClientRead (a frozen pipeline;
-- `ShardLease.reap` says why). Silence counts from the later of state change and statement
-- start, so no session ends sooner than the server's timers would end it.
SELECT a.pid, extract(epoch FROM now() - greatest(a.state_change, a.query_start))::float8,
    pg_terminate_backend(a.pid)
FROM pg_stat_activity a
WHERE a.pid <> pg_backend_pid()
AND (a.state LIKE 'idle%%' OR (a.state = 'active' AND a.wait_event = 'ClientRead'))
AND greatest(a.state_change, a.query_start) < now() - make_interval(secs => %(after_s)s)
AND a.pid IN (
    SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory'
    AND l.granted AND l.mode = 'ExclusiveLock' AND l.objsubid = 2
    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    AND l.classid::int8 = (hashtext(%(key)s)::int8 & 4294967295))

-- name: join-members
-- A shared session lock that marks this session as a live worker of the outbox.
SELECT pg_advisory_lock_shared(hashtext(%(key)s), 0)

-- name: leave-members
-- Stop counting as a live worker (a worker whose broker is unreachable steps out).
SELECT pg_advisory_unlock_shared(hashtext(%(key)s), 0)

-- name: names-now
-- The OID of the claim's name, and whether the mark's name (itself, its partitioned parent,
-- or a view over one) reaches the claimed relation (params: claim, mark, claim_oid).
SELECT coalesce(to_regclass(%(claim)s)::oid, 0)::int8, EXISTS (
    SELECT FROM (SELECT to_regclass(%(mark)s) AS oid) m, LATERAL (
        SELECT m.oid UNION SELECT d.refobjid FROM pg_rewrite r JOIN pg_depend d
        ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid
        AND d.refclassid = 'pg_class'::regclass WHERE r.ev_class = m.oid) AS b(oid)
    WHERE b.oid = %(claim_oid)s::oid OR EXISTS (
        SELECT FROM pg_partition_tree(b.oid) t WHERE t.relid = %(claim_oid)s::oid::regclass))

-- name: table-exists
-- Whether %(schema)s.%(table)s exists (needs no privilege on it).
SELECT EXISTS (
    SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = %(schema)s AND c.relname = %(table)s)

-- name: count-members
-- Live workers of the outbox: sessions holding the shared membership lock (a two-int4
-- advisory lock is classid = key1 compared unsigned, objid = key2, objsubid = 2 in pg_locks).
SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND granted
AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
AND classid::int8 = (hashtext(%(key)s)::int8 & 4294967295) AND objid::int8 = 0
AND objsubid = 2

-- name: table-columns
-- Column names and base types of a relation (params: schema, table); none when it is missing.
SELECT a.attname, format_type(a.atttypid, NULL)
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname = %(table)s AND a.attnum > 0
AND NOT a.attisdropped

-- name: roles-that-can-insert
-- Login roles a REVOKE can stop that may still INSERT into the table (params: relation),
-- column grants included. Superusers and owners are left out: they grant themselves back, so
-- their sessions are the gate's business (relay/switching.py).
SELECT rolname FROM pg_roles WHERE rolcanlogin AND NOT rolsuper
AND NOT pg_has_role(oid, (SELECT relowner FROM pg_class WHERE oid = %(relation)s::regclass),
    'MEMBER')
AND has_any_column_privilege(oid, %(relation)s::regclass, 'INSERT') ORDER BY rolname

-- name: old-app-sessions
-- Sessions of the outgoing application in this database (param: pattern, a LIKE).
SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
AND application_name LIKE %(pattern)s AND pid <> pg_backend_pid()
