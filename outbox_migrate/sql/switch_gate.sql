-- The switching relay's writer gate: evidence beyond the INSERT privilege. Parameters are
-- psycopg's: %(relation)s is text that ::regclass resolves to the flat table.

-- name: bypassing-sessions
-- Client sessions in this database, other than the tool's own, of roles that may insert into the table whatever is revoked (superusers, its owner, members of the owner role); and whether each one's activity is hidden from us.
-- A session of another role shows its backend_type only to members of that role or of
-- pg_read_all_stats: a hidden one may be a client, so it counts (the gate never passes on a
-- NULL), and the relay says which grant would let it tell.
SELECT a.pid, a.usename::text, coalesce(a.application_name, ''), a.backend_type IS NULL
FROM pg_stat_activity a, pg_class c
WHERE c.oid = %(relation)s::regclass
  AND a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND (a.backend_type = 'client backend' OR a.backend_type IS NULL) AND a.usesysid IS NOT NULL
  AND coalesce(a.application_name, '') NOT LIKE %(tool)s
  AND pg_has_role(a.usesysid, c.relowner, 'MEMBER')
ORDER BY a.pid

-- name: rows-inserted
-- Rows ever inserted into the table, as the statistics collector counts them (committed or not, reported when a transaction ends).
SELECT pg_stat_get_tuples_inserted(%(relation)s::regclass)
