-- The relay's statements on its attempts and dead-letter tables, shared by both delivery styles
-- (relay/attempts_sql.py composes them, relay/dead_letters.py runs the operator's commands).
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
