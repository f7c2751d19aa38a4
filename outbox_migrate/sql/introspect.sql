-- Introspection: facts about the live outbox, read from the catalogs.
-- Placeholders: {rel_reg} text literal of the quoted, qualified table name; {id_name},
-- {published_name} column-name literals; {rel_q} identifier; {id_q}, {published_q} columns.

-- name: columns
-- Columns with type, default, nullability, collation, identity and generation.
SELECT a.attname, format_type(a.atttypid, a.atttypmod) AS type, a.atttypid::regtype::text AS base_type,
       pg_get_expr(d.adbin, d.adrelid) AS default_expr, a.attnotnull,
       CASE WHEN a.attcollation <> 0 THEN (SELECT collname FROM pg_collation WHERE oid = a.attcollation) END AS collation,
       a.attidentity::text, a.attgenerated::text
FROM pg_attribute a
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE a.attrelid = to_regclass({rel_reg}) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum

-- name: table
-- Kind, partition status, size and row estimate of the table.
SELECT c.relkind::text, c.relispartition, pg_total_relation_size(c.oid) AS total_bytes,
       pg_relation_size(c.oid) AS heap_bytes,
       -- reltuples is -1 until the first VACUUM or ANALYZE: the live-row counter then
       CASE WHEN c.reltuples >= 0 THEN c.reltuples ELSE coalesce(s.n_live_tup, 0) END::bigint AS row_estimate,
       coalesce(s.n_tup_ins, 0) AS inserts, coalesce(s.n_tup_upd, 0) AS updates,
       coalesce(s.n_tup_del, 0) AS deletes
FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = to_regclass({rel_reg})

-- name: ids
-- Highest id, the identity/serial sequence and its last value.
SELECT (SELECT max({id_q}) FROM {rel_q}) AS max_id,
       coalesce(pg_get_serial_sequence({rel_reg}, {id_name}), {rel_seq}::text) AS sequence,
       CASE WHEN has_sequence_privilege({rel_seq}, 'SELECT,USAGE') THEN pg_sequence_last_value({rel_seq}) END AS last_value,
       pg_get_serial_sequence({rel_reg}, {id_name}) IS NOT NULL AS owned

-- name: unpublished
-- Exact count of unpublished rows (the relay's partial index makes it cheap).
SELECT count(*) FROM {rel_q} WHERE {unpublished}

-- name: indexes
-- Indexes on the table.
SELECT i.relname, pg_get_indexdef(x.indexrelid), x.indisvalid, pg_relation_size(x.indexrelid),
       x.indisprimary, x.indisunique,
       (SELECT conname FROM pg_constraint WHERE conindid = x.indexrelid AND conrelid = x.indrelid LIMIT 1)
FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
WHERE x.indrelid = to_regclass({rel_reg})
ORDER BY i.relname

-- name: constraints
-- Constraints on the table (not the NOT NULLs PostgreSQL 18 catalogues).
SELECT conname, contype::text, pg_get_constraintdef(oid), convalidated, connoinherit
FROM pg_constraint
WHERE conrelid = to_regclass({rel_reg}) AND contype <> 'n'
ORDER BY conname

-- name: triggers
-- User triggers on the table.
SELECT tgname, pg_get_triggerdef(oid), tgenabled::text, tgtype
FROM pg_trigger WHERE tgrelid = to_regclass({rel_reg}) AND NOT tgisinternal
ORDER BY tgname

-- name: foreign-keys-in
-- Foreign keys on other tables that reference this one.
SELECT conname, conrelid::regclass::text FROM pg_constraint
WHERE contype = 'f' AND confrelid = to_regclass({rel_reg})
ORDER BY conname

-- name: foreign-keys-out
-- Foreign keys of this table to others.
SELECT conname, confrelid::regclass::text FROM pg_constraint
WHERE contype = 'f' AND conrelid = to_regclass({rel_reg})
ORDER BY conname

-- name: publications
-- Logical-replication publications that include the table.
SELECT p.pubname, p.puballtables
FROM pg_publication p
WHERE p.puballtables
   OR EXISTS (SELECT 1 FROM pg_publication_rel r WHERE r.prpubid = p.oid AND r.prrelid = to_regclass({rel_reg}))
ORDER BY p.pubname

-- name: relation-kind
-- Whether a relation exists, and its kind (r, p) and parent if it is a partition.
SELECT c.relkind::text, (SELECT i.inhparent::regclass::text FROM pg_inherits i WHERE i.inhrelid = c.oid),
       pg_get_expr(c.relpartbound, c.oid)
FROM pg_class c WHERE c.oid = to_regclass({rel_reg})

-- name: uuid-random
-- Whether the table's uuid ids are version 4 (random, no time order): a few rows decide.
SELECT coalesce(bool_and(substr(x.id::text, 15, 1) = '4'), false)
FROM (SELECT t.{id_q} AS id FROM {rel_q} t LIMIT 20) x

-- name: publication-details
-- Publications covering the table (PostgreSQL 15+): membership kind, options, row filter and column list to carry.
SELECT p.pubname, r.oid IS NOT NULL, p.puballtables,
       EXISTS (SELECT 1 FROM pg_publication_namespace pn WHERE pn.pnpubid = p.oid AND pn.pnnspid = c.relnamespace),
       p.pubviaroot, p.pubinsert, p.pubupdate, p.pubdelete,
       pg_get_expr(r.prqual, r.prrelid),
       (SELECT array_agg(a.attname::text ORDER BY k.ord)
        FROM unnest(r.prattrs::int2[]) WITH ORDINALITY k(attnum, ord)
        JOIN pg_attribute a ON a.attrelid = r.prrelid AND a.attnum = k.attnum)
FROM pg_class c CROSS JOIN pg_publication p
LEFT JOIN pg_publication_rel r ON r.prpubid = p.oid AND r.prrelid = c.oid
WHERE c.oid = to_regclass({rel_reg})
  AND (p.puballtables OR r.oid IS NOT NULL
       OR EXISTS (SELECT 1 FROM pg_publication_namespace pn WHERE pn.pnpubid = p.oid AND pn.pnnspid = c.relnamespace))
ORDER BY p.pubname

-- name: publication-details-14
-- Publications covering the table (PostgreSQL 13-14: no schema publications, row filters or column lists).
SELECT p.pubname, r.oid IS NOT NULL, p.puballtables, false,
       p.pubviaroot, p.pubinsert, p.pubupdate, p.pubdelete, NULL::text, NULL::text[]
FROM pg_class c CROSS JOIN pg_publication p
LEFT JOIN pg_publication_rel r ON r.prpubid = p.oid AND r.prrelid = c.oid
WHERE c.oid = to_regclass({rel_reg}) AND (p.puballtables OR r.oid IS NOT NULL)
ORDER BY p.pubname
