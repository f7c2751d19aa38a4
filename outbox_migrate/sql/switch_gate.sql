-- The switching relay's writer gate: evidence beyond the INSERT privilege. Parameters are
-- psycopg's: %(relation)s is text that ::regclass resolves to the flat table.

-- name: bypassing-sessions
-- Client sessions in this database, other than the tool's own, of roles that may insert into the table whatever is revoked (superusers, its owner, members of the owner role).
SELECT a.pid, a.usename::text, coalesce(a.application_name, '')
FROM pg_stat_activity a, pg_class c
WHERE c.oid = %(relation)s::regclass
  AND a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND a.backend_type = 'client backend' AND a.usesysid IS NOT NULL
  AND coalesce(a.application_name, '') NOT LIKE %(tool)s
  AND pg_has_role(a.usesysid, c.relowner, 'MEMBER')
ORDER BY a.pid

-- name: rows-inserted
-- Rows ever inserted into the table, as the statistics collector counts them (committed or not, reported when a transaction ends).
SELECT pg_stat_get_tuples_inserted(%(relation)s::regclass)
