-- outbox-migrate plan: COP (Cold Outbox Partitioning)
-- public.outbox -> public.outbox_new
-- Apply one phase at a time, between deploys: psql -v ON_ERROR_STOP=1 -f <phase>.sql

-- phase: V1
-- The running version: inserts into and publishes from the flat outbox.
-- (no database steps in this phase)

-- phase: V2
-- Run this phase's steps before deploying V2 (they create the partitioned outbox).
-- V2 inserts every new message into the partitioned table.
-- V2 keeps publishing from the old table only, until it is empty; messages in the new table wait (publication is paused for them).
-- V1 and V2 coexist during the rollout; let the rollout finish.

-- step: cop.v2.create-partitioned-table: Create outbox_new PARTITION BY LIST (published_at), identity starting 1,000,000 above the old table's highest id
BEGIN;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox"')
WHERE to_regclass('"public"."outbox"') IS NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v2.create-partitioned-table [relation-exists:outbox] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s is %s, expected an ordinary table that is not a partition', c.oid::regclass,
              CASE WHEN c.relkind = 'p' THEN 'a partitioned table'
                   WHEN c.relispartition THEN 'already a partition of ' || (
                        SELECT i.inhparent::regclass::text FROM pg_inherits i WHERE i.inhrelid = c.oid)
                   ELSE 'of relkind ' || c.relkind::text END)
FROM pg_class c
WHERE c.oid = to_regclass('"public"."outbox"') AND (c.relkind <> 'r' OR c.relispartition)
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v2.create-partitioned-table [is-plain-table:outbox] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('foreign key %I on %s references %s; drop it or point it elsewhere before migrating',
              conname, conrelid::regclass, '"public"."outbox"')
FROM pg_constraint
WHERE contype = 'f' AND confrelid = to_regclass('"public"."outbox"')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v2.create-partitioned-table [no-fk-references:outbox] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s already exists; was this step applied by hand? inspect it, or reset the ledger', '"public"."outbox_new"')
WHERE to_regclass('"public"."outbox_new"') IS NOT NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v2.create-partitioned-table [relation-absent:outbox_new] failed: %', violation;
    END LOOP;
END
$om_assert$;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
CREATE TABLE "public"."outbox_new" (LIKE "public"."outbox" INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING GENERATED INCLUDING STORAGE INCLUDING COMMENTS) PARTITION BY LIST ("published_at");
SELECT setval(seq, greatest((SELECT max("id") FROM "public"."outbox"), pg_sequence_last_value(pg_get_serial_sequence('"public"."outbox"', 'id')::regclass), 0) + 1000000) FROM (SELECT pg_get_serial_sequence('"public"."outbox_new"', 'id')::regclass AS seq) s WHERE seq IS NOT NULL;
COMMIT;

-- step: cop.v2.create-unpublished-partition: Create outbox_unpublished as the partition FOR VALUES IN (NULL)
BEGIN;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox_new"')
WHERE to_regclass('"public"."outbox_new"') IS NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v2.create-unpublished-partition [relation-exists:outbox_new] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s already exists; was this step applied by hand? inspect it, or reset the ledger', '"public"."outbox_unpublished"')
WHERE to_regclass('"public"."outbox_unpublished"') IS NOT NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v2.create-unpublished-partition [relation-absent:outbox_unpublished] failed: %', violation;
    END LOOP;
END
$om_assert$;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
CREATE TABLE "public"."outbox_unpublished" PARTITION OF "public"."outbox_new" FOR VALUES IN (NULL);
COMMIT;

-- step: cop.v2.create-unpublished-index: Index outbox_unpublished (id) for the relay's claim
BEGIN;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s is not attached to %s %s (found: %s)', '"public"."outbox_unpublished"', '"public"."outbox_new"', 'FOR VALUES IN (NULL)',
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass('"public"."outbox_unpublished"')), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass('"public"."outbox_unpublished"') AND i.inhparent = to_regclass('"public"."outbox_new"')
      AND pg_get_expr(c.relpartbound, c.oid) = 'FOR VALUES IN (NULL)')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v2.create-unpublished-index [partition-bound:outbox_unpublished] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s already exists; was this step applied by hand? inspect it, or reset the ledger', '"public"."outbox_new_unpublished_id_idx"')
WHERE to_regclass('"public"."outbox_new_unpublished_id_idx"') IS NOT NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v2.create-unpublished-index [relation-absent:outbox_new_unpublished_id_idx] failed: %', violation;
    END LOOP;
END
$om_assert$;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
CREATE INDEX "outbox_new_unpublished_id_idx" ON "public"."outbox_unpublished" ("id");
COMMIT;

-- step: cop.v2.create-published-partition: Create outbox_published as the DEFAULT partition (every published row)
BEGIN;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox_new"')
WHERE to_regclass('"public"."outbox_new"') IS NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v2.create-published-partition [relation-exists:outbox_new] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s already exists; was this step applied by hand? inspect it, or reset the ledger', '"public"."outbox_published"')
WHERE to_regclass('"public"."outbox_published"') IS NOT NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v2.create-published-partition [relation-absent:outbox_published] failed: %', violation;
    END LOOP;
END
$om_assert$;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
CREATE TABLE "public"."outbox_published" PARTITION OF "public"."outbox_new" DEFAULT;
COMMIT;

-- step: cop.v2.tune-autovacuum: Insert-only autovacuum settings on outbox_published (every 100 k inserts)
BEGIN;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox_published"')
WHERE to_regclass('"public"."outbox_published"') IS NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v2.tune-autovacuum [relation-exists:outbox_published] failed: %', violation;
    END LOOP;
END
$om_assert$;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
ALTER TABLE "public"."outbox_published" SET (autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 100000, autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 100000);
COMMIT;

-- phase: V3
-- Run this phase's gate before deploying V3: it proves no V1 is left and the old table is fully published.
-- V3 inserts into and publishes from the partitioned table; the paused messages go out now.
-- The old table is no longer used: keep it, archive it or drop it on your own schedule.

-- step: cop.v3.gate-old-table-retired: Gate: no writer inserts into outbox any more and it is fully published
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox"')
WHERE to_regclass('"public"."outbox"') IS NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v3.gate-old-table-retired [relation-exists:outbox] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH seq AS MATERIALIZED (
    SELECT pg_get_serial_sequence('"public"."outbox"', 'id')::regclass AS oid
), before AS MATERIALIZED (
    SELECT seq.oid, pg_sequence_last_value(seq.oid) AS value FROM seq WHERE seq.oid IS NOT NULL
), pause AS MATERIALIZED (
    SELECT pg_sleep(2.0) FROM before
), after AS MATERIALIZED (
    SELECT pg_sequence_last_value(before.oid) AS value FROM before, pause
)
SELECT format('%s is still receiving inserts: %s new ids in %s s; phase %s needs every writer of the old version gone — is the rollout of the previous version finished?',
              '"public"."outbox"', coalesce(after.value, 0) - coalesce(before.value, 0), 2.0, 'V3')
FROM before, after
WHERE coalesce(after.value, 0) > coalesce(before.value, 0)
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v3.gate-old-table-retired [no-new-ids:outbox] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s unpublished rows remain in %s; phase %s needs 0 — is an instance of the old version still publishing from it?',
              count(*), '"public"."outbox"', 'V3')
FROM "public"."outbox" WHERE "published_at" IS NULL
HAVING count(*) > 0
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of cop.v3.gate-old-table-retired [old-table-drained:outbox] failed: %', violation;
    END LOOP;
END
$om_assert$;
