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

-- name: marker-kind
-- The publication column is a timestamp when the steps take NULL as unpublished, and is none when they name a flag's value (revisions built without a database).
SELECT format('%s.%I is %s, but these steps were built for a %s marker: %s',
              {rel_reg}, a.attname, format_type(a.atttypid, a.atttypmod), {kind}, {remedy})
FROM pg_attribute a
WHERE a.attrelid = to_regclass({rel_reg}) AND a.attname = {column_name} AND NOT a.attisdropped
  AND (format_type(a.atttypid, a.atttypmod) LIKE 'timestamp%') <> {is_timestamp}

-- name: partition-bound-value
-- The relation is attached to the parent FOR VALUES IN the flag's unpublished value (quotes aside: '0' and 0 are one bound).
SELECT format('%s is not attached to %s %s (found: %s)', {rel_reg}, {parent_reg}, {bound},
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass({rel_reg})), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass({rel_reg}) AND i.inhparent = to_regclass({parent_reg})
      AND replace(pg_get_expr(c.relpartbound, c.oid), '''', '') = replace({bound}, '''', ''))

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
SELECT format('%s unpublished rows remain in %s; phase %s needs 0 — if a relay still publishes from it, let it finish; if the switching relay already left it (rows a writer added after the switch), publish them with `outbox-migrate relay --mode flat --until-empty` and the same sink, then run this phase again (docs/relay.md, rows left in the old table)',
              count(*), {rel_reg}, {phase})
FROM {rel_q} WHERE {unpublished}
HAVING count(*) > 0

-- name: no-unread-rows
-- No unpublished row waits in the flat table (under its name or retired) where it stands alone and no relay reads it.
SELECT format('%s unpublished row(s) in %s, which no relay reads in phase %s: a writer of a version that must not run now inserted them (or the rename to the original name was rolled back under it) — publish them with `outbox-migrate relay --mode flat --until-empty --table %s` and the same sink, stop that writer, then run this again',
              t.n, t.rel, {phase}, t.rel)
FROM (
    SELECT c.oid::regclass AS rel,
           substring(query_to_xml(format('SELECT count(*) AS n FROM %s WHERE %s', c.oid::regclass, {unpublished_text}),
                                  false, true, '')::text FROM '<n>(\d+)</n>')::int8 AS n
    FROM pg_class c
    WHERE c.oid IN (to_regclass({rel_reg}), to_regclass({retired_reg}))
      AND c.relkind = 'r' AND NOT c.relispartition
) t
WHERE t.n > 0

-- name: no-partitions
-- The partitioned table has no partitions left (dropping it drops nothing else).
SELECT format('%s still has partition %s; it was not created by this migration — detach or drop it yourself first', {rel_reg}, i.inhrelid::regclass)
FROM pg_inherits i
WHERE i.inhparent = to_regclass({rel_reg})

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

-- name: check-implies-partition-constraint-flag
-- The CHECK is "<marker> IS NOT NULL AND <marker> <> <unpublished>", which implies the DEFAULT partition's constraint.
SELECT format('CHECK constraint %I on %s is %s, which does not prove %I IS NOT NULL AND %I <> %s; ATTACH would scan the table',
              conname, {rel_reg}, pg_get_constraintdef(oid), {column_name}, {column_name}, {value})
FROM pg_constraint
WHERE conrelid = to_regclass({rel_reg}) AND conname = {check_name}
  AND pg_get_constraintdef(oid) NOT LIKE format('CHECK (((%I IS NOT NULL) AND %%<>%%', {column_name})

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
        pg_sequence_last_value({rel_seq})) AS top
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

-- name: relation-empty
-- The relation holds no rows (dropping it loses nothing).
SELECT format('%s holds rows; dropping it would lose them — move or publish them first', {rel_reg})
WHERE to_regclass({rel_reg}) IS NOT NULL AND EXISTS (SELECT 1 FROM {rel_q})

-- name: unique-id-index
-- A valid unique index (or primary key) on exactly the id column exists.
SELECT format('%s has no unique index on %I alone; HOPER''s copy-back needs one to skip rows already copied. Create it first: CREATE UNIQUE INDEX CONCURRENTLY ON %s (%I)',
              {rel_reg}, {id_name}, {rel_reg}, {id_name})
WHERE NOT EXISTS (
    SELECT 1 FROM pg_index x JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = x.indkey[0]
    WHERE x.indrelid = to_regclass({rel_reg}) AND x.indisunique AND x.indisvalid
      AND x.indnkeyatts = 1 AND x.indpred IS NULL AND a.attname = {id_name})

-- name: no-enabled-user-triggers
-- The table has no enabled user trigger (internal constraint triggers do not count).
SELECT format('trigger %I on %s is still enabled', tgname, {rel_reg})
FROM pg_trigger
WHERE tgrelid = to_regclass({rel_reg}) AND NOT tgisinternal AND tgenabled <> 'D'

-- name: no-new-ticks
-- No INSERT statement (whether it supplies its ids or not) into the table ticked the gate sequence during a sampling window, and no transaction that inserted is still open at its end (no writer left).
-- The trigger of kinds/gate_sequence.py ticks the sequence when an insert statement ends and
-- holds a shared advisory lock until its transaction ends. Where the sequence stood is kept
-- in a session setting for `no-new-ticks-since-sample`.
WITH before AS MATERIALIZED (
    SELECT to_regclass({seq_reg}) AS oid, pg_sequence_last_value(to_regclass({seq_reg})) AS value
), pause AS MATERIALIZED (
    SELECT pg_sleep({window_s}) FROM before
), after_ AS MATERIALIZED (
    SELECT pg_sequence_last_value(before.oid) AS value,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = ({key1}::int8 & 4294967295)
              AND l.objid::int8 = ({key2}::int8 & 4294967295)) AS open_writers
    FROM before, pause
), after AS MATERIALIZED (
    SELECT after_.value, after_.open_writers,
           set_config({sample_key}, coalesce(after_.value, 0)::text || ':ticks', false) AS saved
    FROM after_
)
SELECT CASE
    WHEN before.oid IS NULL
    THEN format('%s: the gate sequence %s is missing (the gates need the install-gate-sequence step of V2)', {rel_reg}, {seq_reg})
    WHEN coalesce(after.value, 0) > coalesce(before.value, 0)
    THEN format('%s is still receiving inserts: %s insert statements in %s s; phase %s needs every writer of the old version gone — is the rollout of the previous version finished?',
                {rel_reg}, coalesce(after.value, 0) - coalesce(before.value, 0), {window_s}, {phase})
    ELSE format('%s: %s open transaction(s) inserted into it and have not ended; phase %s needs every writer of the old version gone',
                {rel_reg}, after.open_writers, {phase}) END
FROM before LEFT JOIN after ON true
WHERE before.oid IS NULL OR coalesce(after.value, 0) > coalesce(before.value, 0)
   OR after.open_writers > 0

-- name: no-new-ticks-since-sample
-- Under the step's lock: no insert statement ticked the gate sequence since the sampling window, and no transaction that inserted is still open.
WITH saved AS MATERIALIZED (
    SELECT nullif(split_part(coalesce(current_setting({sample_key}, true), ''), ':', 1), '')::bigint AS seq_last,
           coalesce(current_setting({sample_key}, true), '') LIKE '%:ticks' AS sampled
), now_ AS MATERIALIZED (
    SELECT coalesce(pg_sequence_last_value(to_regclass({seq_reg})), 0) AS seq_last,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = ({key1}::int8 & 4294967295)
              AND l.objid::int8 = ({key2}::int8 & 4294967295)) AS open_writers
)
SELECT CASE WHEN NOT saved.sampled
            THEN format('%s: the gate did not sample this table in this session; phase %s needs its sampling window first', {rel_reg}, {phase})
            WHEN now_.open_writers > 0
            THEN format('%s: %s open transaction(s) inserted into it after the gate sampled; phase %s needs every writer of the old version gone', {rel_reg}, now_.open_writers, {phase})
            ELSE format('%s received inserts from a writer of the old version after the gate sampled (gate sequence at %s, was %s); phase %s needs every writer of the old version gone',
                        {rel_reg}, now_.seq_last, saved.seq_last, {phase}) END
FROM now_, saved
WHERE NOT saved.sampled OR now_.seq_last > coalesce(saved.seq_last, 0) OR now_.open_writers > 0

-- name: all-rows-present-by-order
-- Every row of the source is present in the target (by id); for ids with no min()/max() aggregate (uuid).
WITH missing AS MATERIALIZED (
    SELECT s.{id_q} AS id FROM {source_q} s
    WHERE NOT EXISTS (SELECT 1 FROM {rel_q} t WHERE t.{id_q} = s.{id_q})
)
SELECT format('%s rows of %s are missing from %s (ids %s..%s); copy them before dropping the source',
              (SELECT count(*) FROM missing), {source_reg}, {rel_reg},
              (SELECT id FROM missing ORDER BY id LIMIT 1),
              (SELECT id FROM missing ORDER BY id DESC LIMIT 1))
WHERE EXISTS (SELECT FROM missing)

-- name: publication-includes
-- The publication lists the relation (FOR TABLE membership).
SELECT format('publication %I does not list %s; was it altered since `plan`? re-run plan and review the CDC consumer', {pub_name}, {rel_reg})
WHERE NOT EXISTS (
    SELECT 1 FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
    WHERE p.pubname = {pub_name} AND r.prrelid = to_regclass({rel_reg}))

-- name: publication-excludes
-- The publication does not list the relation yet.
SELECT format('publication %I already lists %s; was this step applied by hand? inspect it, or reset the ledger', {pub_name}, {rel_reg})
WHERE EXISTS (
    SELECT 1 FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid
    WHERE p.pubname = {pub_name} AND r.prrelid = to_regclass({rel_reg}))

-- name: replica-identity-full
-- The relation logs whole old rows (REPLICA IDENTITY FULL): a publication that publishes UPDATE or DELETE accepts the relay's mark.
SELECT format('%s has no REPLICA IDENTITY FULL: a publication of its UPDATEs/DELETEs would make every mark fail', {rel_reg})
WHERE NOT EXISTS (SELECT 1 FROM pg_class WHERE oid = to_regclass({rel_reg}) AND relreplident = 'f')

-- name: publications-carried
-- Every publication that lists the old outbox also lists the unpublished partition, which logs whole old rows where the publication publishes UPDATEs (offline SQL has no CDC step of its own).
SELECT format('publication %I lists %s but %s; apply the step publish-unpublished-partition from `outbox-migrate plan --dsn ... --format sql` (or %s) before deploying V2',
              p.pubname, {rel_reg},
              CASE WHEN NOT l.listed
                   THEN format('not %s: its consumer would miss every message V2 writes', {unpublished_reg})
                   ELSE format('%s has no REPLICA IDENTITY FULL: every mark of the V2 relay would fail (cannot update a table that publishes updates without a replica identity)', {unpublished_reg}) END,
              concat_ws('; ',
                        CASE WHEN NOT l.full_identity THEN format('ALTER TABLE %s REPLICA IDENTITY FULL', {unpublished_reg}) END,
                        CASE WHEN NOT l.listed THEN format('ALTER PUBLICATION %I ADD TABLE %s', p.pubname, {unpublished_reg}) END))
FROM pg_publication p JOIN pg_publication_rel r ON r.prpubid = p.oid AND r.prrelid = to_regclass({rel_reg})
CROSS JOIN LATERAL (
    SELECT EXISTS (SELECT 1 FROM pg_publication_rel u
                   WHERE u.prpubid = p.oid AND u.prrelid = to_regclass({unpublished_reg})) AS listed,
           EXISTS (SELECT 1 FROM pg_class c
                   WHERE c.oid = to_regclass({unpublished_reg}) AND c.relreplident = 'f') AS full_identity) l
WHERE NOT l.listed OR ((p.pubupdate OR p.pubdelete) AND NOT l.full_identity)

-- name: no-row-security
-- The table has no row-level security: its policies are not carried to the partitioned table.
SELECT format('%s has row-level security (%s, %s policies); outbox-migrate does not carry policies to %s and its partitions — disable it for the migration (ALTER TABLE %s DISABLE ROW LEVEL SECURITY) and re-create the policies on the partitioned table yourself, or migrate by hand',
              c.oid::regclass, CASE WHEN c.relrowsecurity THEN 'enabled' ELSE 'disabled' END,
              (SELECT count(*) FROM pg_policy p WHERE p.polrelid = c.oid), {parent_reg}, c.oid::regclass)
FROM pg_class c
WHERE c.oid = to_regclass({rel_reg})
  AND (c.relrowsecurity OR EXISTS (SELECT 1 FROM pg_policy p WHERE p.polrelid = c.oid))

-- name: may-give-to-owner
-- The migration's role may give the new tables to the old table's owner: it is that owner or a superuser, or a member of the owner role, which may create in the schema (what ALTER TABLE … OWNER TO checks).
SELECT CASE WHEN NOT pg_has_role(current_user, c.relowner, 'MEMBER')
            THEN format('the migration runs as %I, which is neither %s (the owner of %s) nor a member of it: the tables it creates could not be given to that owner; run it as the owner (or a member of the owner role)',
                        current_user, c.relowner::regrole, c.oid::regclass)
            ELSE format('%s, the owner of %s, may not create in schema %s, so the tables the migration creates could not be given to it; run the migration as %s, or GRANT CREATE ON SCHEMA %s TO %s',
                        c.relowner::regrole, c.oid::regclass, c.relnamespace::regnamespace, c.relowner::regrole, c.relnamespace::regnamespace, c.relowner::regrole) END
FROM pg_class c
WHERE c.oid = to_regclass({rel_reg})
  AND c.relowner <> (SELECT r.oid FROM pg_roles r WHERE r.rolname = current_user)
  AND NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user)
  AND (NOT pg_has_role(current_user, c.relowner, 'MEMBER')
       OR NOT has_schema_privilege(c.relowner, c.relnamespace, 'CREATE'))

-- name: no-trigger-name-clash
-- No trigger on the table has the name of a row trigger of the parent (ATTACH clones the parent's row triggers onto the partition and refuses a name already taken).
SELECT format('trigger %I on %s has the name of row trigger %I on %s, which ATTACH clones onto %s and refuses ("trigger already exists"); rename the one on %s (ALTER TRIGGER %I ON %s RENAME TO …) or the one on %s, then run this step again',
              o.tgname, o.tgrelid::regclass, p.tgname, p.tgrelid::regclass, o.tgrelid::regclass, p.tgrelid::regclass, p.tgname, p.tgrelid::regclass, o.tgrelid::regclass)
FROM pg_trigger o
JOIN pg_trigger p ON p.tgname = o.tgname
WHERE o.tgrelid = to_regclass({rel_reg}) AND p.tgrelid = to_regclass({parent_reg})
  AND (p.tgtype & 1) = 1 AND NOT p.tgisinternal AND o.tgparentid <> p.oid

-- name: dead-letter-grants
-- Every role with UPDATE on the old table (the relay's) may delete from the unpublished partition and write both dead-letter tables.
SELECT format('%s lacks %s on %s: GRANT it (the grant-dead-letters step does)',
              CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END,
              w.privilege, w.rel)
FROM (SELECT DISTINCT a.grantee
      FROM pg_class c, aclexplode(c.relacl) a
      WHERE c.oid = to_regclass({old_reg}) AND a.grantee <> c.relowner
        AND a.privilege_type = 'UPDATE') g,
     (VALUES ({unpublished_reg}, 'DELETE'),
             ({dead_reg}, 'SELECT'), ({dead_reg}, 'INSERT'), ({dead_reg}, 'DELETE'),
             ({attempts_reg}, 'SELECT'), ({attempts_reg}, 'INSERT'),
             ({attempts_reg}, 'UPDATE'), ({attempts_reg}, 'DELETE')) AS w(rel, privilege)
WHERE to_regclass(w.rel) IS NULL
   OR NOT CASE WHEN g.grantee = 0 THEN EXISTS (
              SELECT FROM pg_class c, aclexplode(c.relacl) a
              WHERE c.oid = to_regclass(w.rel) AND a.grantee = 0 AND a.privilege_type = w.privilege)
          ELSE has_table_privilege(g.grantee, to_regclass(w.rel), w.privilege) END
