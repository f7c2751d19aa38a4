-- outbox-migrate plan: COPRA (Cold Outbox Partitioning w/ Rapid Attachment)
-- public.outbox -> public.outbox_new
-- Apply one phase at a time, between deploys: psql -v ON_ERROR_STOP=1 -f <phase>.sql

-- phase: V1
-- The running version: inserts into and publishes from the flat outbox.
-- (no database steps in this phase)

-- phase: V2
-- Run this phase's steps before deploying V2: the partitioned table gets only its unpublished partition, and an
--   identity starting above the old ids.
-- V2 inserts into the partitioned table and publishes from the old table only, until it is empty.
-- V2 must not publish from the partitioned table yet: with no DEFAULT partition the UPDATE of published_at has nowhere
--   to put the row.

-- step: copra.v2.create-partitioned-table: Create outbox_new PARTITION BY LIST (published_at), its own identity
--   starting 1,000,000 above the old table's highest id
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
LOCK TABLE ONLY "public"."outbox" IN ACCESS SHARE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox"')
WHERE to_regclass('"public"."outbox"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-partitioned-table [relation-exists:outbox] failed: %',
            violation;
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
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-partitioned-table [is-plain-table:outbox] failed: %',
            violation;
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
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-partitioned-table [no-fk-references:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"public"."outbox_new"')
WHERE to_regclass('"public"."outbox_new"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-partitioned-table [relation-absent:outbox_new] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format(
        '%s has row-level security (%s, %s policies); outbox-migrate does not carry policies to %s and its partitions '
        '— disable it for the migration (ALTER TABLE %s DISABLE ROW LEVEL SECURITY) and re-create the policies on the '
        'partitioned table yourself, or migrate by hand',
              c.oid::regclass, CASE WHEN c.relrowsecurity THEN 'enabled' ELSE 'disabled' END,
              (SELECT count(*) FROM pg_policy p WHERE p.polrelid = c.oid), '"public"."outbox_new"', c.oid::regclass)
FROM pg_class c
WHERE c.oid = to_regclass('"public"."outbox"')
  AND (c.relrowsecurity OR EXISTS (SELECT 1 FROM pg_policy p WHERE p.polrelid = c.oid))
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-partitioned-table [no-row-security:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT CASE WHEN NOT pg_has_role(current_user, c.relowner, 'MEMBER')
            THEN
                format(
                'the migration runs as %I, which is neither %s (the owner of %s) nor a member of it: the tables it '
                'creates could not be given to that owner; run it as the owner (or a member of the owner role)',
                        current_user, c.relowner::regrole, c.oid::regclass)
            ELSE
                format(
                '%s, the owner of %s, may not create in schema %s, so the tables the migration creates could not be '
                'given to it; run the migration as %s, or GRANT CREATE ON SCHEMA %s TO %s',
                        c.relowner::regrole, c.oid::regclass, c.relnamespace::regnamespace, c.relowner::regrole,
                            c.relnamespace::regnamespace, c.relowner::regrole) END
FROM pg_class c
WHERE c.oid = to_regclass('"public"."outbox"')
  AND c.relowner <> (SELECT r.oid FROM pg_roles r WHERE r.rolname = current_user)
  AND NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user)
  AND (NOT pg_has_role(current_user, c.relowner, 'MEMBER')
       OR NOT has_schema_privilege(c.relowner, c.relnamespace, 'CREATE'))
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-partitioned-table [may-give-to-owner:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
CREATE TABLE "public"."outbox_new"
    (LIKE "public"."outbox" INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING GENERATED INCLUDING CONSTRAINTS
    INCLUDING STORAGE INCLUDING COMMENTS) PARTITION BY LIST ("published_at");
ALTER TABLE "public"."outbox_new" ALTER COLUMN "id" DROP IDENTITY IF EXISTS;
ALTER TABLE "public"."outbox_new" ALTER COLUMN "id" DROP DEFAULT;
ALTER TABLE "public"."outbox_new" ALTER COLUMN "id" ADD GENERATED ALWAYS AS IDENTITY;
SELECT
    setval(seq,
    greatest((SELECT max("id") FROM "public"."outbox"),
    pg_sequence_last_value(
    coalesce(pg_get_serial_sequence('"public"."outbox"', 'id')::regclass,
    (SELECT d.refobjid::regclass FROM pg_attrdef ad JOIN pg_attribute a ON a.attrelid = ad.adrelid
    AND a.attnum = ad.adnum JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid
    AND d.refclassid = 'pg_class'::regclass JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S'
    WHERE ad.adrelid = to_regclass('"public"."outbox"') AND a.attname = 'id' LIMIT 1))), 0) + 1000000)
    FROM (SELECT pg_get_serial_sequence('"public"."outbox_new"', 'id')::regclass AS seq) s WHERE seq IS NOT NULL;
DO $om$
DECLARE
    old_rel regclass := '"public"."outbox"'::regclass;
    new_rel regclass := '"public"."outbox_new"'::regclass;
    wanted text[] := NULL::text[];
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"public"."outbox"'::regclass);
    g record;
BEGIN
    FOR g IN
        SELECT NULL::name AS col, a.grantee, a.privilege_type, a.is_grantable
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = old_rel AND a.grantee <> old_owner
          AND (wanted IS NULL OR a.privilege_type = ANY (wanted))
        UNION ALL
        SELECT t.attname, a.grantee, a.privilege_type, a.is_grantable
        FROM pg_attribute t, aclexplode(t.attacl) a
        WHERE t.attrelid = old_rel AND t.attnum > 0 AND NOT t.attisdropped
          AND a.grantee <> old_owner
          AND (wanted IS NULL OR a.privilege_type = ANY (wanted))
    LOOP
        EXECUTE format('GRANT %s%s ON TABLE %s TO %s%s', g.privilege_type,
            CASE WHEN g.col IS NULL THEN '' ELSE format(' (%I)', g.col) END, new_rel,
            CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END,
            CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    IF old_owner <> (SELECT relowner FROM pg_class WHERE oid = new_rel) THEN
        EXECUTE format('ALTER TABLE %s OWNER TO %s', new_rel, old_owner::regrole);
    END IF;
END
$om$;
COMMIT;

-- step: copra.v2.create-unpublished-partition: Create outbox_unpublished as the partition FOR VALUES IN (NULL)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
LOCK TABLE ONLY "public"."outbox_new" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox_new"')
WHERE to_regclass('"public"."outbox_new"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-unpublished-partition [relation-exists:outbox_new] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"public"."outbox_unpublished"')
WHERE to_regclass('"public"."outbox_unpublished"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-unpublished-partition '
            '[relation-absent:outbox_unpublished] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s.%I is %s, but these steps were built for a %s marker: %s',
              '"public"."outbox"', a.attname, format_type(a.atttypid, a.atttypmod), 'timestamp (NULL = unpublished)',
                  'set unpublished_value and published_value (or build the steps with a database, which reads the '
                  'flag''s DEFAULT)')
FROM pg_attribute a
WHERE a.attrelid = to_regclass('"public"."outbox"') AND a.attname = 'published_at' AND NOT a.attisdropped
  AND (format_type(a.atttypid, a.atttypmod) LIKE 'timestamp%') <> true
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-unpublished-partition [marker-kind:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
CREATE TABLE "public"."outbox_unpublished" PARTITION OF "public"."outbox_new" FOR VALUES IN (NULL);
DO $om$
DECLARE
    old_rel regclass := '"public"."outbox"'::regclass;
    new_rel regclass := '"public"."outbox_unpublished"'::regclass;
    wanted text[] := ARRAY['SELECT', 'UPDATE']::text[];
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"public"."outbox"'::regclass);
    g record;
BEGIN
    FOR g IN
        SELECT NULL::name AS col, a.grantee, a.privilege_type, a.is_grantable
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = old_rel AND a.grantee <> old_owner
          AND (wanted IS NULL OR a.privilege_type = ANY (wanted))
        UNION ALL
        SELECT t.attname, a.grantee, a.privilege_type, a.is_grantable
        FROM pg_attribute t, aclexplode(t.attacl) a
        WHERE t.attrelid = old_rel AND t.attnum > 0 AND NOT t.attisdropped
          AND a.grantee <> old_owner
          AND (wanted IS NULL OR a.privilege_type = ANY (wanted))
    LOOP
        EXECUTE format('GRANT %s%s ON TABLE %s TO %s%s', g.privilege_type,
            CASE WHEN g.col IS NULL THEN '' ELSE format(' (%I)', g.col) END, new_rel,
            CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END,
            CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    IF old_owner <> (SELECT relowner FROM pg_class WHERE oid = new_rel) THEN
        EXECUTE format('ALTER TABLE %s OWNER TO %s', new_rel, old_owner::regrole);
    END IF;
END
$om$;
COMMIT;

-- step: copra.v2.create-dead-letter-tables: Create outbox_dead_letter and outbox_dead_letter_attempts, the relay's dead
--   letters
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox"')
WHERE to_regclass('"public"."outbox"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-dead-letter-tables [relation-exists:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
CREATE TABLE "public"."outbox_dead_letter"
    (source_table text NOT NULL, id int8 NOT NULL, event_type text, message_key text, payload text NOT NULL,
    payload_bytes bytea, created_at timestamptz NOT NULL, attempts int NOT NULL, last_error text NOT NULL,
    dead_at timestamptz NOT NULL DEFAULT now(), headers jsonb, reasons text[] NOT NULL DEFAULT '{}',
    delivered int NOT NULL DEFAULT 0, PRIMARY KEY (source_table, id));
CREATE TABLE "public"."outbox_dead_letter_attempts"
    (source_table text NOT NULL, id int8 NOT NULL, attempts int NOT NULL, last_error text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(), reasons text[] NOT NULL DEFAULT '{}',
    delivered int NOT NULL DEFAULT 0, PRIMARY KEY (source_table, id));
DO $om$
DECLARE
    old_rel regclass := '"public"."outbox"'::regclass;
    new_rel regclass := '"public"."outbox_dead_letter"'::regclass;
    wanted text[] := ARRAY[]::text[];
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"public"."outbox"'::regclass);
    g record;
BEGIN
    FOR g IN
        SELECT NULL::name AS col, a.grantee, a.privilege_type, a.is_grantable
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = old_rel AND a.grantee <> old_owner
          AND (wanted IS NULL OR a.privilege_type = ANY (wanted))
        UNION ALL
        SELECT t.attname, a.grantee, a.privilege_type, a.is_grantable
        FROM pg_attribute t, aclexplode(t.attacl) a
        WHERE t.attrelid = old_rel AND t.attnum > 0 AND NOT t.attisdropped
          AND a.grantee <> old_owner
          AND (wanted IS NULL OR a.privilege_type = ANY (wanted))
    LOOP
        EXECUTE format('GRANT %s%s ON TABLE %s TO %s%s', g.privilege_type,
            CASE WHEN g.col IS NULL THEN '' ELSE format(' (%I)', g.col) END, new_rel,
            CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END,
            CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    IF old_owner <> (SELECT relowner FROM pg_class WHERE oid = new_rel) THEN
        EXECUTE format('ALTER TABLE %s OWNER TO %s', new_rel, old_owner::regrole);
    END IF;
END
$om$;
DO $om$
DECLARE
    old_rel regclass := '"public"."outbox"'::regclass;
    new_rel regclass := '"public"."outbox_dead_letter_attempts"'::regclass;
    wanted text[] := ARRAY[]::text[];
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"public"."outbox"'::regclass);
    g record;
BEGIN
    FOR g IN
        SELECT NULL::name AS col, a.grantee, a.privilege_type, a.is_grantable
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = old_rel AND a.grantee <> old_owner
          AND (wanted IS NULL OR a.privilege_type = ANY (wanted))
        UNION ALL
        SELECT t.attname, a.grantee, a.privilege_type, a.is_grantable
        FROM pg_attribute t, aclexplode(t.attacl) a
        WHERE t.attrelid = old_rel AND t.attnum > 0 AND NOT t.attisdropped
          AND a.grantee <> old_owner
          AND (wanted IS NULL OR a.privilege_type = ANY (wanted))
    LOOP
        EXECUTE format('GRANT %s%s ON TABLE %s TO %s%s', g.privilege_type,
            CASE WHEN g.col IS NULL THEN '' ELSE format(' (%I)', g.col) END, new_rel,
            CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END,
            CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    IF old_owner <> (SELECT relowner FROM pg_class WHERE oid = new_rel) THEN
        EXECUTE format('ALTER TABLE %s OWNER TO %s', new_rel, old_owner::regrole);
    END IF;
END
$om$;
COMMIT;

-- step: copra.v2.grant-dead-letters: Grant the relay's roles what dead-lettering needs on outbox_dead_letter,
--   outbox_dead_letter_attempts and outbox_unpublished
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox"')
WHERE to_regclass('"public"."outbox"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.grant-dead-letters [relation-exists:outbox] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)',
        '"public"."outbox_unpublished"')
WHERE to_regclass('"public"."outbox_unpublished"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.grant-dead-letters [relation-exists:outbox_unpublished] failed: '
            '%', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)',
        '"public"."outbox_dead_letter"')
WHERE to_regclass('"public"."outbox_dead_letter"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.grant-dead-letters [relation-exists:outbox_dead_letter] failed: '
            '%', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)',
        '"public"."outbox_dead_letter_attempts"')
WHERE to_regclass('"public"."outbox_dead_letter_attempts"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.grant-dead-letters '
            '[relation-exists:outbox_dead_letter_attempts] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om$
DECLARE
    old_rel regclass := '"public"."outbox"'::regclass;
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"public"."outbox"'::regclass);
    g record;
    t regclass;
BEGIN
    FOR g IN
        SELECT DISTINCT a.grantee
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = old_rel AND a.grantee <> old_owner AND a.privilege_type = 'UPDATE'
    LOOP
        FOREACH t IN ARRAY ARRAY['"public"."outbox_dead_letter"'::regclass,
            '"public"."outbox_dead_letter_attempts"'::regclass] LOOP
            EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE %s TO %s', t,
                CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END);
        END LOOP;
        EXECUTE format('GRANT DELETE ON TABLE %s TO %s', '"public"."outbox_unpublished"'::regclass,
            CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END);
    END LOOP;
END
$om$;
COMMIT;

-- step: copra.v2.create-unpublished-index: Index outbox_unpublished (id) for the relay's claim
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
LOCK TABLE ONLY "public"."outbox_unpublished" IN SHARE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s is not attached to %s %s (found: %s)', '"public"."outbox_unpublished"', '"public"."outbox_new"',
        'FOR VALUES IN (NULL)',
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass('"public"."outbox_unpublished"')), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass('"public"."outbox_unpublished"') AND i.inhparent = to_regclass('"public"."outbox_new"')
      AND pg_get_expr(c.relpartbound, c.oid) = 'FOR VALUES IN (NULL)')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-unpublished-index [partition-bound:outbox_unpublished] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"public"."outbox_new_unpublished_id_idx"')
WHERE to_regclass('"public"."outbox_new_unpublished_id_idx"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.create-unpublished-index '
            '[relation-absent:outbox_new_unpublished_id_idx] failed: %', violation;
    END LOOP;
END
$om_assert$;
CREATE INDEX "outbox_new_unpublished_id_idx" ON "public"."outbox_unpublished" ("id");
COMMIT;

-- step: copra.v2.guard-unpublished: Guard outbox_unpublished: unpublished rows other sessions DELETE are written back
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "public"."outbox_new" IN SHARE ROW EXCLUSIVE MODE;
LOCK TABLE ONLY "public"."outbox_unpublished" IN SHARE ROW EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s is not attached to %s %s (found: %s)', '"public"."outbox_unpublished"', '"public"."outbox_new"',
        'FOR VALUES IN (NULL)',
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass('"public"."outbox_unpublished"')), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass('"public"."outbox_unpublished"') AND i.inhparent = to_regclass('"public"."outbox_new"')
      AND pg_get_expr(c.relpartbound, c.oid) = 'FOR VALUES IN (NULL)')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.guard-unpublished [partition-bound:outbox_unpublished] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('trigger %I still exists on %s', 'outbox_unpublished_guard', '"public"."outbox_unpublished"')
FROM pg_trigger WHERE tgrelid = to_regclass('"public"."outbox_unpublished"') AND tgname = 'outbox_unpublished_guard'
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v2.guard-unpublished [trigger-absent:guard] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('trigger %I still exists on %s', 'outbox_unpublished_guard', '"public"."outbox_new"')
FROM pg_trigger WHERE tgrelid = to_regclass('"public"."outbox_new"') AND tgname = 'outbox_unpublished_guard'
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.guard-unpublished [trigger-absent:guard-parent] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('function %s still exists', '"public"."outbox_unpublished_guard"')
WHERE to_regproc('"public"."outbox_unpublished_guard"') IS NOT NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v2.guard-unpublished [function-absent:guard] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
CREATE FUNCTION "public"."outbox_unpublished_guard"() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, "public" AS $om$
DECLARE
    stored text;
BEGIN
    -- the unpublished rows this DELETE removed go back (SET LOCAL outbox_migrate.unpublished_guard = off
    -- to delete them); every stored column, by name, so a column added later is kept
    SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) INTO stored
    FROM pg_attribute
    WHERE attrelid = TG_RELID AND attnum > 0 AND NOT attisdropped AND attgenerated = '';
    EXECUTE format('INSERT INTO %I.%I (%s) OVERRIDING SYSTEM VALUE '
                   'SELECT %s FROM om_deleted WHERE %I IS NULL',
                   TG_TABLE_SCHEMA, TG_TABLE_NAME, stored, stored, 'published_at');
    RETURN NULL;
END
$om$;
CREATE TRIGGER "outbox_unpublished_guard" AFTER DELETE ON "public"."outbox_unpublished" REFERENCING OLD TABLE AS
    om_deleted FOR EACH STATEMENT WHEN
    (current_setting('outbox_migrate.unpublished_guard', true) IS DISTINCT FROM 'off') EXECUTE FUNCTION
    "public"."outbox_unpublished_guard"();
CREATE TRIGGER "outbox_unpublished_guard" AFTER DELETE ON "public"."outbox_new" REFERENCING OLD TABLE AS om_deleted
    FOR EACH STATEMENT WHEN (current_setting('outbox_migrate.unpublished_guard', true) IS DISTINCT FROM 'off') EXECUTE
    FUNCTION "public"."outbox_unpublished_guard"();
COMMIT;

-- step: copra.v2.install-notify-trigger: Statement-level AFTER INSERT trigger on outbox_new waking an idle relay
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "public"."outbox_new" IN SHARE ROW EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s is not partitioned by LIST (%s)', '"public"."outbox_new"', 'published_at')
WHERE NOT EXISTS (
    SELECT 1
    FROM pg_partitioned_table pt
    JOIN pg_attribute a ON a.attrelid = pt.partrelid AND a.attnum = pt.partattrs[0]
    WHERE pt.partrelid = to_regclass('"public"."outbox_new"') AND pt.partstrat = 'l' AND pt.partnatts = 1
      AND a.attname = 'published_at')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.install-notify-trigger [partitioned-by-list:outbox_new] failed: '
            '%', violation;
    END LOOP;
END
$om_assert$;
CREATE OR REPLACE FUNCTION "public"."outbox_new_relay_notify"() RETURNS trigger LANGUAGE plpgsql AS $om$
BEGIN
    -- an idle relay holds this lock exclusively: only then is a NOTIFY worth its
    -- commit-time cost; the key stands for this table's name (idle_lock_key in
    -- outbox_migrate/relay/notify.py)
    IF NOT pg_try_advisory_xact_lock_shared(-1919037244, 0) THEN
        PERFORM pg_notify(TG_ARGV[0], (SELECT min("id")::text FROM "new_rows"));
    END IF;
    RETURN NULL;
END
$om$;
CREATE TRIGGER "relay_notify" AFTER INSERT ON "public"."outbox_new" REFERENCING NEW TABLE AS "new_rows"
    FOR EACH STATEMENT EXECUTE FUNCTION "public"."outbox_new_relay_notify"('outbox_migrate_relay');
COMMIT;

-- step: copra.v2.install-gate-sequence: Sequence outbox_gate_seq ticked by every INSERT statement into outbox: what the
--   deploy gates watch (ids supplied or generated alike)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "public"."outbox" IN SHARE ROW EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox"')
WHERE to_regclass('"public"."outbox"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.install-gate-sequence [relation-exists:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"public"."outbox_gate_seq"')
WHERE to_regclass('"public"."outbox_gate_seq"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.install-gate-sequence [relation-absent:outbox_gate_seq] failed: '
            '%', violation;
    END LOOP;
END
$om_assert$;
CREATE SEQUENCE "public"."outbox_gate_seq" AS bigint CACHE 1;
CREATE FUNCTION "public"."outbox_gate_tick"() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog AS $om$
BEGIN
    -- a writer's INSERT (also one made by the application's own triggers), not
    -- HOPIA's copy of a published row, which raises this flag around its INSERT
    IF coalesce(current_setting('outbox_migrate.copying', true), '') <> 'on' THEN
        PERFORM nextval('"public"."outbox_gate_seq"'::regclass);
        PERFORM pg_advisory_xact_lock_shared(hashtext('outbox-migrate.gate'), hashtext('"public"."outbox"'));
    END IF;
    RETURN NULL;
END
$om$;
CREATE TRIGGER "outbox_gate_tick" AFTER INSERT ON "public"."outbox"
    FOR EACH STATEMENT EXECUTE FUNCTION "public"."outbox_gate_tick"();
COMMIT;

-- check: no publication lists outbox without outbox_unpublished (CDC consumers)
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format(
        'publication %I lists %s but %s; apply the step publish-unpublished-partition from `outbox-migrate plan --dsn '
        '... --format sql` (or %s) before deploying V2',
              p.pubname, '"public"."outbox"',
              CASE WHEN NOT l.listed
                   THEN
                       format('not %s: its consumer would miss every message V2 writes',
                       '"public"."outbox_unpublished"')
                   ELSE
                       format(
                       '%s has no REPLICA IDENTITY FULL: every mark of the V2 relay would fail (cannot update a table '
                       'that publishes updates without a replica identity)', '"public"."outbox_unpublished"') END,
              concat_ws('; ',
                        CASE WHEN NOT l.full_identity THEN
                            format('ALTER TABLE %s REPLICA IDENTITY FULL', '"public"."outbox_unpublished"') END,
                        CASE WHEN NOT l.listed THEN
                            format('ALTER PUBLICATION %I ADD TABLE %s', p.pubname, '"public"."outbox_unpublished"')
                            END))
FROM pg_publication p JOIN pg_publication_rel r ON r.prpubid = p.oid AND r.prrelid = to_regclass('"public"."outbox"')
CROSS JOIN LATERAL (
    SELECT EXISTS (SELECT 1 FROM pg_publication_rel u
                   WHERE u.prpubid = p.oid AND u.prrelid = to_regclass('"public"."outbox_unpublished"')) AS listed,
           EXISTS (SELECT 1 FROM pg_class c
                   WHERE c.oid = to_regclass('"public"."outbox_unpublished"')
                       AND c.relreplident = 'f') AS full_identity) l
WHERE NOT l.listed OR ((p.pubupdate OR p.pubdelete) AND NOT l.full_identity)
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v2.install-gate-sequence (CDC) [publications-carried] failed: %',
            violation;
    END LOOP;
END
$om_assert$;

-- phase: V3
-- Run this phase's steps once V2 is fully rolled out and the old table is drained (the gate checks both).
-- V3 behaves like V2; the database now has the old table as the published partition.

-- step: copra.v3.gate-old-table-retired: Gate: no writer inserts into outbox any more and it is fully published
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN -- The trigger of kinds/gate_sequence.py ticks the sequence when an insert statement ends and
-- holds a shared advisory lock until its transaction ends. Where the sequence stood is kept
-- in a session setting for `no-new-ticks-since-sample`.
WITH before AS MATERIALIZED (
    SELECT to_regclass('"public"."outbox_gate_seq"') AS oid,
        pg_sequence_last_value(to_regclass('"public"."outbox_gate_seq"')) AS value
), pause AS MATERIALIZED (
    SELECT pg_sleep(2.0) FROM before
), after_ AS MATERIALIZED (
    SELECT pg_sequence_last_value(before.oid) AS value,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"public"."outbox"')::int8 & 4294967295)) AS open_writers
    FROM before, pause
), after AS MATERIALIZED (
    SELECT after_.value, after_.open_writers,
           set_config('outbox_migrate.gate_69376700', coalesce(after_.value, 0)::text || ':ticks', false) AS saved
    FROM after_
)
SELECT CASE
    WHEN before.oid IS NULL
    THEN
        format('%s: the gate sequence %s is missing (the gates need the install-gate-sequence step of V2)',
        '"public"."outbox"', '"public"."outbox_gate_seq"')
    WHEN coalesce(after.value, 0) > coalesce(before.value, 0)
    THEN
        format(
        '%s is still receiving inserts: %s insert statements in %s s; phase %s needs every writer of the old version '
        'gone — is the rollout of the previous version finished?',
                '"public"."outbox"', coalesce(after.value, 0) - coalesce(before.value, 0), 2.0, 'V3')
    ELSE
        format(
        '%s: %s open transaction(s) inserted into it and have not ended; phase %s needs every writer of the old '
        'version gone',
                '"public"."outbox"', after.open_writers, 'V3') END
FROM before LEFT JOIN after ON true
WHERE before.oid IS NULL OR coalesce(after.value, 0) > coalesce(before.value, 0)
   OR after.open_writers > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.gate-old-table-retired [no-new-ticks:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox"')
WHERE to_regclass('"public"."outbox"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.gate-old-table-retired [relation-exists:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH saved AS MATERIALIZED (
    SELECT nullif(split_part(coalesce(current_setting('outbox_migrate.gate_69376700', true), ''), ':', 1), '')::bigint
        AS seq_last,
           coalesce(current_setting('outbox_migrate.gate_69376700', true), '') LIKE '%:ticks' AS sampled
), now_ AS MATERIALIZED (
    SELECT coalesce(pg_sequence_last_value(to_regclass('"public"."outbox_gate_seq"')), 0) AS seq_last,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"public"."outbox"')::int8 & 4294967295)) AS open_writers
)
SELECT CASE WHEN NOT saved.sampled
            THEN
                format(
                '%s: the gate did not sample this table in this session; phase %s needs its sampling window first',
                '"public"."outbox"', 'V3')
            WHEN now_.open_writers > 0
            THEN
                format(
                '%s: %s open transaction(s) inserted into it after the gate sampled; phase %s needs every writer of '
                'the old version gone', '"public"."outbox"', now_.open_writers, 'V3')
            ELSE
                format(
                '%s received inserts from a writer of the old version after the gate sampled (gate sequence at %s, '
                'was %s); phase %s needs every writer of the old version gone',
                        '"public"."outbox"', now_.seq_last, saved.seq_last, 'V3') END
FROM now_, saved
WHERE NOT saved.sampled OR now_.seq_last > coalesce(saved.seq_last, 0) OR now_.open_writers > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.gate-old-table-retired [no-new-ticks-since-sample:outbox] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format(
        '%s unpublished rows remain in %s; phase %s needs 0 — if a relay still publishes from it, let it finish; if '
        'the switching relay already left it (rows a writer added after the switch), publish them with '
        '`outbox-migrate relay --mode flat --until-empty` and the same sink, then run this phase again '
        '(docs/relay.md, rows left in the old table)',
              count(*), '"public"."outbox"', 'V3')
FROM "public"."outbox" WHERE "published_at" IS NULL
HAVING count(*) > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.gate-old-table-retired [old-table-drained:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;

-- step: copra.v3.drop-identity: Drop IDENTITY from outbox.id (a partition may not have one)
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN -- The trigger of kinds/gate_sequence.py ticks the sequence when an insert statement ends and
-- holds a shared advisory lock until its transaction ends. Where the sequence stood is kept
-- in a session setting for `no-new-ticks-since-sample`.
WITH before AS MATERIALIZED (
    SELECT to_regclass('"public"."outbox_gate_seq"') AS oid,
        pg_sequence_last_value(to_regclass('"public"."outbox_gate_seq"')) AS value
), pause AS MATERIALIZED (
    SELECT pg_sleep(2.0) FROM before
), after_ AS MATERIALIZED (
    SELECT pg_sequence_last_value(before.oid) AS value,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"public"."outbox"')::int8 & 4294967295)) AS open_writers
    FROM before, pause
), after AS MATERIALIZED (
    SELECT after_.value, after_.open_writers,
           set_config('outbox_migrate.gate_69376700', coalesce(after_.value, 0)::text || ':ticks', false) AS saved
    FROM after_
)
SELECT CASE
    WHEN before.oid IS NULL
    THEN
        format('%s: the gate sequence %s is missing (the gates need the install-gate-sequence step of V2)',
        '"public"."outbox"', '"public"."outbox_gate_seq"')
    WHEN coalesce(after.value, 0) > coalesce(before.value, 0)
    THEN
        format(
        '%s is still receiving inserts: %s insert statements in %s s; phase %s needs every writer of the old version '
        'gone — is the rollout of the previous version finished?',
                '"public"."outbox"', coalesce(after.value, 0) - coalesce(before.value, 0), 2.0, 'V3')
    ELSE
        format(
        '%s: %s open transaction(s) inserted into it and have not ended; phase %s needs every writer of the old '
        'version gone',
                '"public"."outbox"', after.open_writers, 'V3') END
FROM before LEFT JOIN after ON true
WHERE before.oid IS NULL OR coalesce(after.value, 0) > coalesce(before.value, 0)
   OR after.open_writers > 0
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v3.drop-identity [no-new-ticks:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "public"."outbox" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox"')
WHERE to_regclass('"public"."outbox"') IS NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v3.drop-identity [relation-exists:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH saved AS MATERIALIZED (
    SELECT nullif(split_part(coalesce(current_setting('outbox_migrate.gate_69376700', true), ''), ':', 1), '')::bigint
        AS seq_last,
           coalesce(current_setting('outbox_migrate.gate_69376700', true), '') LIKE '%:ticks' AS sampled
), now_ AS MATERIALIZED (
    SELECT coalesce(pg_sequence_last_value(to_regclass('"public"."outbox_gate_seq"')), 0) AS seq_last,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"public"."outbox"')::int8 & 4294967295)) AS open_writers
)
SELECT CASE WHEN NOT saved.sampled
            THEN
                format(
                '%s: the gate did not sample this table in this session; phase %s needs its sampling window first',
                '"public"."outbox"', 'V3')
            WHEN now_.open_writers > 0
            THEN
                format(
                '%s: %s open transaction(s) inserted into it after the gate sampled; phase %s needs every writer of '
                'the old version gone', '"public"."outbox"', now_.open_writers, 'V3')
            ELSE
                format(
                '%s received inserts from a writer of the old version after the gate sampled (gate sequence at %s, '
                'was %s); phase %s needs every writer of the old version gone',
                        '"public"."outbox"', now_.seq_last, saved.seq_last, 'V3') END
FROM now_, saved
WHERE NOT saved.sampled OR now_.seq_last > coalesce(saved.seq_last, 0) OR now_.open_writers > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.drop-identity [no-new-ticks-since-sample:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH new_seq AS (
    SELECT s.seqstart, s.seqincrement, pg_sequence_last_value(s.seqrelid) AS last
    FROM pg_sequence s
    WHERE s.seqrelid = pg_get_serial_sequence('"public"."outbox_new"', 'id')::regclass
), old_top AS (
    SELECT greatest(
        (SELECT max("id") FROM "public"."outbox"),
        pg_sequence_last_value(
            coalesce(pg_get_serial_sequence('"public"."outbox"', 'id')::regclass,
            (SELECT d.refobjid::regclass FROM pg_attrdef ad JOIN pg_attribute a ON a.attrelid = ad.adrelid
            AND a.attnum = ad.adnum JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid
            AND d.refclassid = 'pg_class'::regclass JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S'
            WHERE ad.adrelid = to_regclass('"public"."outbox"') AND a.attname = 'id' LIMIT 1)))) AS top
)
SELECT format('the identity of %s will issue id %s but %s already reaches id %s; raise the START (id_headroom)',
              '"public"."outbox_new"', coalesce(n.last + n.seqincrement, n.seqstart), '"public"."outbox"', o.top)
FROM new_seq n, old_top o
WHERE o.top IS NOT NULL AND coalesce(n.last + n.seqincrement, n.seqstart) <= o.top
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v3.drop-identity [new-ids-above-old] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "public"."outbox" ALTER COLUMN "id" DROP IDENTITY IF EXISTS;
COMMIT;

-- step: copra.v3.add-not-valid-check: Add CHECK (published_at IS NOT NULL) NOT VALID to outbox
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN -- The trigger of kinds/gate_sequence.py ticks the sequence when an insert statement ends and
-- holds a shared advisory lock until its transaction ends. Where the sequence stood is kept
-- in a session setting for `no-new-ticks-since-sample`.
WITH before AS MATERIALIZED (
    SELECT to_regclass('"public"."outbox_gate_seq"') AS oid,
        pg_sequence_last_value(to_regclass('"public"."outbox_gate_seq"')) AS value
), pause AS MATERIALIZED (
    SELECT pg_sleep(2.0) FROM before
), after_ AS MATERIALIZED (
    SELECT pg_sequence_last_value(before.oid) AS value,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"public"."outbox"')::int8 & 4294967295)) AS open_writers
    FROM before, pause
), after AS MATERIALIZED (
    SELECT after_.value, after_.open_writers,
           set_config('outbox_migrate.gate_69376700', coalesce(after_.value, 0)::text || ':ticks', false) AS saved
    FROM after_
)
SELECT CASE
    WHEN before.oid IS NULL
    THEN
        format('%s: the gate sequence %s is missing (the gates need the install-gate-sequence step of V2)',
        '"public"."outbox"', '"public"."outbox_gate_seq"')
    WHEN coalesce(after.value, 0) > coalesce(before.value, 0)
    THEN
        format(
        '%s is still receiving inserts: %s insert statements in %s s; phase %s needs every writer of the old version '
        'gone — is the rollout of the previous version finished?',
                '"public"."outbox"', coalesce(after.value, 0) - coalesce(before.value, 0), 2.0, 'V3')
    ELSE
        format(
        '%s: %s open transaction(s) inserted into it and have not ended; phase %s needs every writer of the old '
        'version gone',
                '"public"."outbox"', after.open_writers, 'V3') END
FROM before LEFT JOIN after ON true
WHERE before.oid IS NULL OR coalesce(after.value, 0) > coalesce(before.value, 0)
   OR after.open_writers > 0
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v3.add-not-valid-check [no-new-ticks:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "public"."outbox" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH saved AS MATERIALIZED (
    SELECT nullif(split_part(coalesce(current_setting('outbox_migrate.gate_69376700', true), ''), ':', 1), '')::bigint
        AS seq_last,
           coalesce(current_setting('outbox_migrate.gate_69376700', true), '') LIKE '%:ticks' AS sampled
), now_ AS MATERIALIZED (
    SELECT coalesce(pg_sequence_last_value(to_regclass('"public"."outbox_gate_seq"')), 0) AS seq_last,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"public"."outbox"')::int8 & 4294967295)) AS open_writers
)
SELECT CASE WHEN NOT saved.sampled
            THEN
                format(
                '%s: the gate did not sample this table in this session; phase %s needs its sampling window first',
                '"public"."outbox"', 'V3')
            WHEN now_.open_writers > 0
            THEN
                format(
                '%s: %s open transaction(s) inserted into it after the gate sampled; phase %s needs every writer of '
                'the old version gone', '"public"."outbox"', now_.open_writers, 'V3')
            ELSE
                format(
                '%s received inserts from a writer of the old version after the gate sampled (gate sequence at %s, '
                'was %s); phase %s needs every writer of the old version gone',
                        '"public"."outbox"', now_.seq_last, saved.seq_last, 'V3') END
FROM now_, saved
WHERE NOT saved.sampled OR now_.seq_last > coalesce(saved.seq_last, 0) OR now_.open_writers > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.add-not-valid-check [no-new-ticks-since-sample:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format(
        '%s unpublished rows remain in %s; phase %s needs 0 — if a relay still publishes from it, let it finish; if '
        'the switching relay already left it (rows a writer added after the switch), publish them with '
        '`outbox-migrate relay --mode flat --until-empty` and the same sink, then run this phase again '
        '(docs/relay.md, rows left in the old table)',
              count(*), '"public"."outbox"', 'V3')
FROM "public"."outbox" WHERE "published_at" IS NULL
HAVING count(*) > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.add-not-valid-check [old-table-drained:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "public"."outbox" ADD CONSTRAINT "outbox_published_check" CHECK ("published_at" IS NOT NULL) NOT VALID;
COMMIT;

-- step: copra.v3.remove-gate-sequence: Drop the gate trigger and outbox_gate_seq: the last deploy gate passed
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "public"."outbox" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox"')
WHERE to_regclass('"public"."outbox"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.remove-gate-sequence [relation-exists:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DROP TRIGGER IF EXISTS "outbox_gate_tick" ON "public"."outbox";
DROP FUNCTION IF EXISTS "public"."outbox_gate_tick"();
DROP SEQUENCE IF EXISTS "public"."outbox_gate_seq";
COMMIT;

-- step: copra.v3.validate-check: VALIDATE the CHECK on outbox in its own transaction
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '0ms';
LOCK TABLE ONLY "public"."outbox" IN SHARE UPDATE EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('CHECK constraint %I is missing on %s', 'outbox_published_check', '"public"."outbox"')
WHERE NOT EXISTS (
    SELECT 1 FROM pg_constraint
    WHERE conrelid = to_regclass('"public"."outbox"') AND conname = 'outbox_published_check' AND contype = 'c')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v3.validate-check [check-exists] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format(
        '%s unpublished rows remain in %s; phase %s needs 0 — if a relay still publishes from it, let it finish; if '
        'the switching relay already left it (rows a writer added after the switch), publish them with '
        '`outbox-migrate relay --mode flat --until-empty` and the same sink, then run this phase again '
        '(docs/relay.md, rows left in the old table)',
              count(*), '"public"."outbox"', 'V3')
FROM "public"."outbox" WHERE "published_at" IS NULL
HAVING count(*) > 0
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v3.validate-check [old-table-drained:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "public"."outbox" VALIDATE CONSTRAINT "outbox_published_check";
COMMIT;

-- step: copra.v3.attach-old-as-default: ATTACH outbox to outbox_new as the DEFAULT partition (no scan)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '1000ms';
LOCK TABLE ONLY "public"."outbox_new" IN SHARE UPDATE EXCLUSIVE MODE;
LOCK TABLE ONLY "public"."outbox" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"public"."outbox_published"')
WHERE to_regclass('"public"."outbox_published"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.attach-old-as-default [relation-absent:outbox_published] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox_new"')
WHERE to_regclass('"public"."outbox_new"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.attach-old-as-default [relation-exists:outbox_new] failed: %',
            violation;
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
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.attach-old-as-default [is-plain-table:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('CHECK constraint %I is missing on %s', 'outbox_published_check', '"public"."outbox"')
WHERE NOT EXISTS (
    SELECT 1 FROM pg_constraint
    WHERE conrelid = to_regclass('"public"."outbox"') AND conname = 'outbox_published_check' AND contype = 'c')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v3.attach-old-as-default [check-exists] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('CHECK constraint %I on %s is NOT VALID; run its VALIDATE step first', 'outbox_published_check',
        '"public"."outbox"')
FROM pg_constraint
WHERE conrelid = to_regclass('"public"."outbox"') AND conname = 'outbox_published_check' AND NOT convalidated
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v3.attach-old-as-default [check-validated] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('CHECK constraint %I on %s is %s, which does not prove %I IS NOT NULL; ATTACH would scan the table',
              conname, '"public"."outbox"', pg_get_constraintdef(oid), 'published_at')
FROM pg_constraint
WHERE conrelid = to_regclass('"public"."outbox"') AND conname = 'outbox_published_check'
  AND pg_get_constraintdef(oid) <> format('CHECK ((%I IS NOT NULL))', 'published_at')
  AND pg_get_constraintdef(oid) <> format('CHECK ((%I IS NOT NULL)) NOT VALID', 'published_at')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.attach-old-as-default [check-implies-partition-constraint] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH parent AS (
    SELECT attname, atttypid, atttypmod, attcollation, attnotnull
    FROM pg_attribute WHERE attrelid = to_regclass('"public"."outbox_new"') AND attnum > 0 AND NOT attisdropped
), child AS (
    SELECT attname, atttypid, atttypmod, attcollation, attnotnull
    FROM pg_attribute WHERE attrelid = to_regclass('"public"."outbox"') AND attnum > 0 AND NOT attisdropped
)
SELECT format('column %I differs: %s has %s, %s has %s', coalesce(p.attname, c.attname),
              '"public"."outbox_new"',
                  coalesce(format_type(p.atttypid, p.atttypmod) || CASE WHEN p.attnotnull THEN ' NOT NULL' ELSE '' END,
                  'no such column'),
              '"public"."outbox"',
                  coalesce(format_type(c.atttypid, c.atttypmod) || CASE WHEN c.attnotnull THEN ' NOT NULL' ELSE '' END,
                  'no such column'))
FROM parent p FULL JOIN child c ON c.attname = p.attname
WHERE p.attname IS NULL OR c.attname IS NULL
   OR p.atttypid <> c.atttypid OR p.atttypmod <> c.atttypmod OR p.attcollation <> c.attcollation
   OR (p.attnotnull AND NOT c.attnotnull)
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.attach-old-as-default [columns-match:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s.%I is still an identity column; a partition may not have one', '"public"."outbox"', 'id')
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
WHERE a.attrelid = to_regclass('"public"."outbox"') AND a.attname = 'id' AND a.attidentity <> ''
  AND NOT c.relispartition
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v3.attach-old-as-default [no-identity:outbox] failed: %',
            violation;
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
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.attach-old-as-default [no-fk-references:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format(
        'trigger %I on %s has the name of row trigger %I on %s, which ATTACH clones onto %s and refuses ("trigger '
        'already exists"); rename the one on %s (ALTER TRIGGER %I ON %s RENAME TO …) or the one on %s, then run this '
        'step again',
              o.tgname, o.tgrelid::regclass, p.tgname, p.tgrelid::regclass, o.tgrelid::regclass, p.tgrelid::regclass,
                  p.tgname, p.tgrelid::regclass, o.tgrelid::regclass)
FROM pg_trigger o
JOIN pg_trigger p ON p.tgname = o.tgname
WHERE o.tgrelid = to_regclass('"public"."outbox"') AND p.tgrelid = to_regclass('"public"."outbox_new"')
  AND (p.tgtype & 1) = 1 AND NOT p.tgisinternal AND o.tgparentid <> p.oid
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.attach-old-as-default [no-trigger-name-clash] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH new_seq AS (
    SELECT s.seqstart, s.seqincrement, pg_sequence_last_value(s.seqrelid) AS last
    FROM pg_sequence s
    WHERE s.seqrelid = pg_get_serial_sequence('"public"."outbox_new"', 'id')::regclass
), old_top AS (
    SELECT greatest(
        (SELECT max("id") FROM "public"."outbox"),
        pg_sequence_last_value(
            coalesce(pg_get_serial_sequence('"public"."outbox"', 'id')::regclass,
            (SELECT d.refobjid::regclass FROM pg_attrdef ad JOIN pg_attribute a ON a.attrelid = ad.adrelid
            AND a.attnum = ad.adnum JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid
            AND d.refclassid = 'pg_class'::regclass JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S'
            WHERE ad.adrelid = to_regclass('"public"."outbox"') AND a.attname = 'id' LIMIT 1)))) AS top
)
SELECT format('the identity of %s will issue id %s but %s already reaches id %s; raise the START (id_headroom)',
              '"public"."outbox_new"', coalesce(n.last + n.seqincrement, n.seqstart), '"public"."outbox"', o.top)
FROM new_seq n, old_top o
WHERE o.top IS NOT NULL AND coalesce(n.last + n.seqincrement, n.seqstart) <= o.top
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v3.attach-old-as-default [new-ids-above-old] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format(
        '%s unpublished rows remain in %s; phase %s needs 0 — if a relay still publishes from it, let it finish; if '
        'the switching relay already left it (rows a writer added after the switch), publish them with '
        '`outbox-migrate relay --mode flat --until-empty` and the same sink, then run this phase again '
        '(docs/relay.md, rows left in the old table)',
              count(*), '"public"."outbox"', 'V3')
FROM "public"."outbox" WHERE "published_at" IS NULL
HAVING count(*) > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.attach-old-as-default [old-table-drained:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "public"."outbox_new" ATTACH PARTITION "public"."outbox" DEFAULT;
COMMIT;

-- step: copra.v3.drop-check: Drop the now-redundant CHECK from outbox (the partition bound says it)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "public"."outbox" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s is not attached to %s %s (found: %s)', '"public"."outbox"', '"public"."outbox_new"', 'DEFAULT',
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass('"public"."outbox"')), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass('"public"."outbox"') AND i.inhparent = to_regclass('"public"."outbox_new"')
      AND pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of copra.v3.drop-check [partition-bound:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "public"."outbox" DROP CONSTRAINT IF EXISTS "outbox_published_check";
COMMIT;

-- step: copra.v3.tune-autovacuum-old: Insert-only autovacuum settings on outbox (every 100 k inserts)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "public"."outbox" IN SHARE UPDATE EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"public"."outbox"')
WHERE to_regclass('"public"."outbox"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of copra.v3.tune-autovacuum-old [relation-exists:outbox] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "public"."outbox" SET
    (autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 100000,
    autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 100000);
COMMIT;

-- phase: V4
-- Deploy V4: it inserts into and publishes from the partitioned table; the paused messages go out now.
-- Published rows land in the old table, which is now the DEFAULT partition.
-- (no database steps in this phase)
