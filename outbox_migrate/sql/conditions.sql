-- Conditions: each query returns one text row per violation and no rows when it holds.
-- Every message says what was observed and what to do, because it is printed as-is by the
-- runner and raised as-is by the offline (psql / alembic --sql) assertions.
-- Placeholders: *_reg are text literals of quoted, schema-qualified names (for ::regclass),
-- *_q are identifiers, *_name are plain-name literals.

-- name: relation-exists
-- The relation exists.
SELECT format('%s does not exist; check the schema and table names (outbox-migrate config)', {rel_reg})
WHERE to_regclass({rel_reg}) IS NULL

-- name: relation-absent
-- The relation does not exist.
SELECT format('%s already exists; was this step applied by hand? inspect it, or reset the ledger', {rel_reg})
WHERE to_regclass({rel_reg}) IS NOT NULL

-- name: is-plain-table
-- The relation is an ordinary table, not itself partitioned or a partition.
SELECT format('%s is %s, expected an ordinary table that is not a partition', c.oid::regclass,
              CASE WHEN c.relkind = 'p' THEN 'a partitioned table'
                   WHEN c.relispartition THEN 'already a partition of ' || (
                        SELECT i.inhparent::regclass::text FROM pg_inherits i WHERE i.inhrelid = c.oid)
                   ELSE 'of relkind ' || c.relkind::text END)
FROM pg_class c
WHERE c.oid = to_regclass({rel_reg}) AND (c.relkind <> 'r' OR c.relispartition)

-- name: partitioned-by-list
-- The parent is partitioned BY LIST on the publication column.
SELECT format('%s is not partitioned by LIST (%s)', {rel_reg}, {column_name})
WHERE NOT EXISTS (
    SELECT 1
    FROM pg_partitioned_table pt
    JOIN pg_attribute a ON a.attrelid = pt.partrelid AND a.attnum = pt.partattrs[0]
    WHERE pt.partrelid = to_regclass({rel_reg}) AND pt.partstrat = 'l' AND pt.partnatts = 1
      AND a.attname = {column_name})

-- name: partition-bound
-- The relation is attached to the parent with the expected bound.
SELECT format('%s is not attached to %s %s (found: %s)', {rel_reg}, {parent_reg}, {bound},
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass({rel_reg})), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass({rel_reg}) AND i.inhparent = to_regclass({parent_reg})
      AND pg_get_expr(c.relpartbound, c.oid) = {bound})

-- name: not-a-partition-of
-- The relation is not (or no longer) a partition of the parent.
SELECT format('%s is still a partition of %s', {rel_reg}, {parent_reg})
FROM pg_inherits i
WHERE i.inhrelid = to_regclass({rel_reg}) AND i.inhparent = to_regclass({parent_reg})

-- name: index-exists
-- The index exists on the relation.
SELECT format('index %s on %s does not exist', {index_reg}, {rel_reg})
WHERE NOT EXISTS (
    SELECT 1 FROM pg_index x
    WHERE x.indexrelid = to_regclass({index_reg}) AND x.indrelid = to_regclass({rel_reg})
      AND x.indisvalid)

-- name: old-table-drained
-- No unpublished rows remain in the table.
SELECT format('%s unpublished rows remain in %s; phase %s needs 0 — is an instance of the old version still publishing from it?',
              count(*), {rel_reg}, {phase})
FROM {rel_q} WHERE {column_q} IS NULL
HAVING count(*) > 0

-- name: no-new-ids
-- Nobody takes new ids from the table's sequence during a sampling window (no writer left).
WITH seq AS MATERIALIZED (
    SELECT pg_get_serial_sequence({rel_reg}, {id_name})::regclass AS oid
), before AS MATERIALIZED (
    SELECT seq.oid, pg_sequence_last_value(seq.oid) AS value FROM seq WHERE seq.oid IS NOT NULL
), pause AS MATERIALIZED (
    SELECT pg_sleep({window_s}) FROM before
), after AS MATERIALIZED (
    SELECT pg_sequence_last_value(before.oid) AS value FROM before, pause
)
SELECT format('%s is still receiving inserts: %s new ids in %s s; phase %s needs every writer of the old version gone — is the rollout of the previous version finished?',
              {rel_reg}, coalesce(after.value, 0) - coalesce(before.value, 0), {window_s}, {phase})
FROM before, after
WHERE coalesce(after.value, 0) > coalesce(before.value, 0)

-- name: no-old-app-sessions
-- No session of the outgoing application version is connected.
SELECT format('%s sessions with application_name like %L are still connected (pids %s); phase %s needs the old version gone',
              count(*), {pattern}, string_agg(pid::text, ',' ORDER BY pid), {phase})
FROM pg_stat_activity
WHERE application_name LIKE {pattern} AND pid <> pg_backend_pid() AND datname = current_database()
HAVING count(*) > 0

-- name: check-exists
-- The CHECK constraint exists on the table.
SELECT format('CHECK constraint %I is missing on %s', {check_name}, {rel_reg})
WHERE NOT EXISTS (
    SELECT 1 FROM pg_constraint
    WHERE conrelid = to_regclass({rel_reg}) AND conname = {check_name} AND contype = 'c')

-- name: check-validated
-- The CHECK constraint is validated, so PostgreSQL may rely on it to skip scans.
SELECT format('CHECK constraint %I on %s is NOT VALID; run its VALIDATE step first', {check_name}, {rel_reg})
FROM pg_constraint
WHERE conrelid = to_regclass({rel_reg}) AND conname = {check_name} AND NOT convalidated

-- name: check-implies-partition-constraint
-- The CHECK is exactly "<published_at> IS NOT NULL", the DEFAULT partition's implied constraint.
SELECT format('CHECK constraint %I on %s is %s, which does not prove %I IS NOT NULL; ATTACH would scan the table',
              conname, {rel_reg}, pg_get_constraintdef(oid), {column_name})
FROM pg_constraint
WHERE conrelid = to_regclass({rel_reg}) AND conname = {check_name}
  AND pg_get_constraintdef(oid) <> format('CHECK ((%I IS NOT NULL))', {column_name})
  AND pg_get_constraintdef(oid) <> format('CHECK ((%I IS NOT NULL)) NOT VALID', {column_name})

-- name: check-absent
-- The CHECK constraint is gone.
SELECT format('CHECK constraint %I still exists on %s', {check_name}, {rel_reg})
FROM pg_constraint
WHERE conrelid = to_regclass({rel_reg}) AND conname = {check_name}

-- name: column-not-null
-- The column is NOT NULL.
SELECT format('%s.%I is nullable', {rel_reg}, {column_name})
FROM pg_attribute
WHERE attrelid = to_regclass({rel_reg}) AND attname = {column_name} AND NOT attnotnull

-- name: no-identity
-- The column has no identity of its own (a partition may not have one; 17+ shows the parent's).
SELECT format('%s.%I is still an identity column; a partition may not have one', {rel_reg}, {column_name})
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
WHERE a.attrelid = to_regclass({rel_reg}) AND a.attname = {column_name} AND a.attidentity <> ''
  AND NOT c.relispartition

-- name: columns-match
-- The table has exactly the parent's columns: names, types, typmods and collations.
WITH parent AS (
    SELECT attname, atttypid, atttypmod, attcollation, attnotnull
    FROM pg_attribute WHERE attrelid = to_regclass({parent_reg}) AND attnum > 0 AND NOT attisdropped
), child AS (
    SELECT attname, atttypid, atttypmod, attcollation, attnotnull
    FROM pg_attribute WHERE attrelid = to_regclass({rel_reg}) AND attnum > 0 AND NOT attisdropped
)
SELECT format('column %I differs: %s has %s, %s has %s', coalesce(p.attname, c.attname),
              {parent_reg}, coalesce(format_type(p.atttypid, p.atttypmod) || CASE WHEN p.attnotnull THEN ' NOT NULL' ELSE '' END, 'no such column'),
              {rel_reg}, coalesce(format_type(c.atttypid, c.atttypmod) || CASE WHEN c.attnotnull THEN ' NOT NULL' ELSE '' END, 'no such column'))
FROM parent p FULL JOIN child c ON c.attname = p.attname
WHERE p.attname IS NULL OR c.attname IS NULL
   OR p.atttypid <> c.atttypid OR p.atttypmod <> c.atttypmod OR p.attcollation <> c.attcollation
   OR (p.attnotnull AND NOT c.attnotnull)

-- name: new-ids-above-old
-- The new table's identity will only issue ids above every id the old table holds or issued.
WITH new_seq AS (
    SELECT s.seqstart, s.seqincrement, pg_sequence_last_value(s.seqrelid) AS last
    FROM pg_sequence s
    WHERE s.seqrelid = pg_get_serial_sequence({parent_reg}, {id_name})::regclass
), old_top AS (
    SELECT greatest(
        (SELECT max({id_q}) FROM {rel_q}),
        pg_sequence_last_value(pg_get_serial_sequence({rel_reg}, {id_name})::regclass)) AS top
)
SELECT format('the identity of %s will issue id %s but %s already reaches id %s; raise the START (id_headroom)',
              {parent_reg}, coalesce(n.last + n.seqincrement, n.seqstart), {rel_reg}, o.top)
FROM new_seq n, old_top o
WHERE o.top IS NOT NULL AND coalesce(n.last + n.seqincrement, n.seqstart) <= o.top

-- name: trigger-exists
-- The trigger exists and is enabled.
SELECT format('trigger %I on %s is missing or disabled', {trigger_name}, {rel_reg})
WHERE NOT EXISTS (
    SELECT 1 FROM pg_trigger
    WHERE tgrelid = to_regclass({rel_reg}) AND tgname = {trigger_name} AND tgenabled <> 'D')

-- name: trigger-absent
-- The trigger is gone.
SELECT format('trigger %I still exists on %s', {trigger_name}, {rel_reg})
FROM pg_trigger WHERE tgrelid = to_regclass({rel_reg}) AND tgname = {trigger_name}

-- name: function-absent
-- The function is gone.
SELECT format('function %s still exists', {function_reg})
WHERE to_regproc({function_reg}) IS NOT NULL

-- name: autovacuum-tuned
-- The relation carries the insert-only autovacuum settings.
SELECT format('%s lacks autovacuum setting %s', {rel_reg}, wanted)
FROM unnest({settings}::text[]) AS wanted
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c
    WHERE c.oid = to_regclass({rel_reg}) AND wanted = ANY (coalesce(c.reloptions, '{{}}')))

-- name: autovacuum-default
-- The relation carries none of the insert-only autovacuum settings.
SELECT format('%s still has autovacuum setting %s', {rel_reg}, opt)
FROM pg_class c, unnest(c.reloptions) AS opt
WHERE c.oid = to_regclass({rel_reg}) AND opt LIKE 'autovacuum_%'

-- name: all-rows-present
-- Every row of the source is present in the target (by id).
SELECT format('%s rows of %s are missing from %s (ids %s..%s); copy them before dropping the source',
              count(*), {source_reg}, {rel_reg}, min(s.{id_q}), max(s.{id_q}))
FROM {source_q} s
WHERE NOT EXISTS (SELECT 1 FROM {rel_q} t WHERE t.{id_q} = s.{id_q})
HAVING count(*) > 0

-- name: no-fk-references
-- No foreign key references the table (a partition cannot keep them working across the swap).
SELECT format('foreign key %I on %s references %s; drop it or point it elsewhere before migrating',
              conname, conrelid::regclass, {rel_reg})
FROM pg_constraint
WHERE contype = 'f' AND confrelid = to_regclass({rel_reg})

-- name: no-id-clash
-- No id exists in both the table and the parent's other partitions.
SELECT format('id %s exists in both %s and %s; ids must be unique across partitions', n.{id_q}, {rel_reg}, {parent_reg})
FROM {parent_q} n
WHERE n.tableoid <> to_regclass({rel_reg})
  AND EXISTS (SELECT 1 FROM {rel_q} o WHERE o.{id_q} = n.{id_q})
LIMIT 5

-- name: relation-empty
-- The relation holds no rows (dropping it loses nothing).
SELECT format('%s holds rows; dropping it would lose them — move or publish them first', {rel_reg})
WHERE to_regclass({rel_reg}) IS NOT NULL AND EXISTS (SELECT 1 FROM {rel_q})
