-- outbox-migrate plan: HOPIA (Hot Outbox Partitioning w/ Immediate Access)
-- billing.Events -> billing.events_p
-- Apply one phase at a time, between deploys: psql -v ON_ERROR_STOP=1 -f <phase>.sql

-- phase: V1
-- The running version: inserts into and publishes from the flat outbox.
-- (no database steps in this phase)

-- phase: V2
-- Run this phase's steps before deploying V2: identity above the old ids, and the AFTER INSERT trigger that copies
--   every published row into the old table.
-- V2 inserts into the partitioned table.
-- V2's relay runs in switching mode: old table until drained and no writer is left, then the partitioned table
--   (outbox-migrate relay --mode switching).
-- Once no V1 instance is left, as the old table's owner: REVOKE INSERT ON the old table FROM the application's role.
--   The switching relay's default gate (--switch-gate privilege) waits for it. A REVOKE does not stop a superuser or
--   the table's owner: while a session of theirs is connected the relay waits instead for V1's sessions to be gone
--   (--old-app-name) and the old table to stay quiet (docs/relay.md).

-- step: hopia.v2.create-partitioned-table: Create events_p PARTITION BY LIST (published_at), its own identity starting
--   1,000,000 above the old table's highest id
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
LOCK TABLE ONLY "billing"."Events" IN ACCESS SHARE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."Events"')
WHERE to_regclass('"billing"."Events"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-partitioned-table [relation-exists:Events] failed: %',
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
WHERE c.oid = to_regclass('"billing"."Events"') AND (c.relkind <> 'r' OR c.relispartition)
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-partitioned-table [is-plain-table:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('foreign key %I on %s references %s; drop it or point it elsewhere before migrating',
              conname, conrelid::regclass, '"billing"."Events"')
FROM pg_constraint
WHERE contype = 'f' AND confrelid = to_regclass('"billing"."Events"')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-partitioned-table [no-fk-references:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"billing"."events_p"')
WHERE to_regclass('"billing"."events_p"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-partitioned-table [relation-absent:events_p] failed: %',
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
              (SELECT count(*) FROM pg_policy p WHERE p.polrelid = c.oid), '"billing"."events_p"', c.oid::regclass)
FROM pg_class c
WHERE c.oid = to_regclass('"billing"."Events"')
  AND (c.relrowsecurity OR EXISTS (SELECT 1 FROM pg_policy p WHERE p.polrelid = c.oid))
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-partitioned-table [no-row-security:Events] failed: %',
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
WHERE c.oid = to_regclass('"billing"."Events"')
  AND c.relowner <> (SELECT r.oid FROM pg_roles r WHERE r.rolname = current_user)
  AND NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user)
  AND (NOT pg_has_role(current_user, c.relowner, 'MEMBER')
       OR NOT has_schema_privilege(c.relowner, c.relnamespace, 'CREATE'))
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-partitioned-table [may-give-to-owner:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
CREATE TABLE "billing"."events_p"
    (LIKE "billing"."Events" INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING GENERATED INCLUDING CONSTRAINTS
    INCLUDING STORAGE INCLUDING COMMENTS) PARTITION BY LIST ("published_at");
ALTER TABLE "billing"."events_p" ALTER COLUMN "id" DROP IDENTITY IF EXISTS;
ALTER TABLE "billing"."events_p" ALTER COLUMN "id" DROP DEFAULT;
ALTER TABLE "billing"."events_p" ALTER COLUMN "id" ADD GENERATED ALWAYS AS IDENTITY;
SELECT
    setval(seq,
    greatest((SELECT max("id") FROM "billing"."Events"),
    pg_sequence_last_value(
    coalesce(pg_get_serial_sequence('"billing"."Events"', 'id')::regclass,
    (SELECT d.refobjid::regclass FROM pg_attrdef ad JOIN pg_attribute a ON a.attrelid = ad.adrelid
    AND a.attnum = ad.adnum JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid
    AND d.refclassid = 'pg_class'::regclass JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S'
    WHERE ad.adrelid = to_regclass('"billing"."Events"') AND a.attname = 'id' LIMIT 1))), 0) + 1000000)
    FROM (SELECT pg_get_serial_sequence('"billing"."events_p"', 'id')::regclass AS seq) s WHERE seq IS NOT NULL;
DO $om$
DECLARE
    old_rel regclass := '"billing"."Events"'::regclass;
    new_rel regclass := '"billing"."events_p"'::regclass;
    wanted text[] := NULL::text[];
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"billing"."Events"'::regclass);
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

-- step: hopia.v2.create-unpublished-partition: Create events_todo as the partition FOR VALUES IN (NULL)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
LOCK TABLE ONLY "billing"."events_p" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."events_p"')
WHERE to_regclass('"billing"."events_p"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-unpublished-partition [relation-exists:events_p] failed: '
            '%', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"billing"."events_todo"')
WHERE to_regclass('"billing"."events_todo"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-unpublished-partition [relation-absent:events_todo] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s.%I is %s, but these steps were built for a %s marker: %s',
              '"billing"."Events"', a.attname, format_type(a.atttypid, a.atttypmod), 'timestamp (NULL = unpublished)',
                  'set unpublished_value and published_value (or build the steps with a database, which reads the '
                  'flag''s DEFAULT)')
FROM pg_attribute a
WHERE a.attrelid = to_regclass('"billing"."Events"') AND a.attname = 'published_at' AND NOT a.attisdropped
  AND (format_type(a.atttypid, a.atttypmod) LIKE 'timestamp%') <> true
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-unpublished-partition [marker-kind:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
CREATE TABLE "billing"."events_todo" PARTITION OF "billing"."events_p" FOR VALUES IN (NULL);
DO $om$
DECLARE
    old_rel regclass := '"billing"."Events"'::regclass;
    new_rel regclass := '"billing"."events_todo"'::regclass;
    wanted text[] := ARRAY['SELECT', 'UPDATE']::text[];
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"billing"."Events"'::regclass);
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

-- step: hopia.v2.create-dead-letter-tables: Create outbox_dead_letter and outbox_dead_letter_attempts, the relay's dead
--   letters
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."Events"')
WHERE to_regclass('"billing"."Events"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-dead-letter-tables [relation-exists:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
CREATE TABLE "billing"."outbox_dead_letter"
    (source_table text NOT NULL, id int8 NOT NULL, event_type text, message_key text, payload text NOT NULL,
    payload_bytes bytea, created_at timestamptz NOT NULL, attempts int NOT NULL, last_error text NOT NULL,
    dead_at timestamptz NOT NULL DEFAULT now(), headers jsonb, reasons text[] NOT NULL DEFAULT '{}',
    delivered int NOT NULL DEFAULT 0, PRIMARY KEY (source_table, id));
CREATE TABLE "billing"."outbox_dead_letter_attempts"
    (source_table text NOT NULL, id int8 NOT NULL, attempts int NOT NULL, last_error text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(), reasons text[] NOT NULL DEFAULT '{}',
    delivered int NOT NULL DEFAULT 0, PRIMARY KEY (source_table, id));
DO $om$
DECLARE
    old_rel regclass := '"billing"."Events"'::regclass;
    new_rel regclass := '"billing"."outbox_dead_letter"'::regclass;
    wanted text[] := ARRAY[]::text[];
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"billing"."Events"'::regclass);
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
    old_rel regclass := '"billing"."Events"'::regclass;
    new_rel regclass := '"billing"."outbox_dead_letter_attempts"'::regclass;
    wanted text[] := ARRAY[]::text[];
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"billing"."Events"'::regclass);
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

-- step: hopia.v2.grant-dead-letters: Grant the relay's roles what dead-lettering needs on outbox_dead_letter,
--   outbox_dead_letter_attempts and events_todo
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."Events"')
WHERE to_regclass('"billing"."Events"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.grant-dead-letters [relation-exists:Events] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."events_todo"')
WHERE to_regclass('"billing"."events_todo"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.grant-dead-letters [relation-exists:events_todo] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)',
        '"billing"."outbox_dead_letter"')
WHERE to_regclass('"billing"."outbox_dead_letter"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.grant-dead-letters [relation-exists:outbox_dead_letter] failed: '
            '%', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)',
        '"billing"."outbox_dead_letter_attempts"')
WHERE to_regclass('"billing"."outbox_dead_letter_attempts"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.grant-dead-letters '
            '[relation-exists:outbox_dead_letter_attempts] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om$
DECLARE
    old_rel regclass := '"billing"."Events"'::regclass;
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"billing"."Events"'::regclass);
    g record;
    t regclass;
BEGIN
    FOR g IN
        SELECT DISTINCT a.grantee
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = old_rel AND a.grantee <> old_owner AND a.privilege_type = 'UPDATE'
    LOOP
        FOREACH t IN ARRAY ARRAY['"billing"."outbox_dead_letter"'::regclass,
            '"billing"."outbox_dead_letter_attempts"'::regclass] LOOP
            EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE %s TO %s', t,
                CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END);
        END LOOP;
        EXECUTE format('GRANT DELETE ON TABLE %s TO %s', '"billing"."events_todo"'::regclass,
            CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END);
    END LOOP;
END
$om$;
COMMIT;

-- step: hopia.v2.create-unpublished-index: Index events_todo (id) for the relay's claim
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
LOCK TABLE ONLY "billing"."events_todo" IN SHARE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s is not attached to %s %s (found: %s)', '"billing"."events_todo"', '"billing"."events_p"',
        'FOR VALUES IN (NULL)',
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass('"billing"."events_todo"')), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass('"billing"."events_todo"') AND i.inhparent = to_regclass('"billing"."events_p"')
      AND pg_get_expr(c.relpartbound, c.oid) = 'FOR VALUES IN (NULL)')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-unpublished-index [partition-bound:events_todo] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"billing"."events_p_unpublished_id_idx"')
WHERE to_regclass('"billing"."events_p_unpublished_id_idx"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-unpublished-index '
            '[relation-absent:events_p_unpublished_id_idx] failed: %', violation;
    END LOOP;
END
$om_assert$;
CREATE INDEX "events_p_unpublished_id_idx" ON "billing"."events_todo" ("id");
COMMIT;

-- step: hopia.v2.guard-unpublished: Guard events_todo: unpublished rows other sessions DELETE are written back
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."events_p" IN SHARE ROW EXCLUSIVE MODE;
LOCK TABLE ONLY "billing"."events_todo" IN SHARE ROW EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s is not attached to %s %s (found: %s)', '"billing"."events_todo"', '"billing"."events_p"',
        'FOR VALUES IN (NULL)',
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass('"billing"."events_todo"')), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass('"billing"."events_todo"') AND i.inhparent = to_regclass('"billing"."events_p"')
      AND pg_get_expr(c.relpartbound, c.oid) = 'FOR VALUES IN (NULL)')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.guard-unpublished [partition-bound:events_todo] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('trigger %I still exists on %s', 'events_todo_guard', '"billing"."events_todo"')
FROM pg_trigger WHERE tgrelid = to_regclass('"billing"."events_todo"') AND tgname = 'events_todo_guard'
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v2.guard-unpublished [trigger-absent:guard] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('trigger %I still exists on %s', 'events_todo_guard', '"billing"."events_p"')
FROM pg_trigger WHERE tgrelid = to_regclass('"billing"."events_p"') AND tgname = 'events_todo_guard'
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.guard-unpublished [trigger-absent:guard-parent] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('function %s still exists', '"billing"."events_todo_guard"')
WHERE to_regproc('"billing"."events_todo_guard"') IS NOT NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v2.guard-unpublished [function-absent:guard] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
CREATE FUNCTION "billing"."events_todo_guard"() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, "billing" AS $om$
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
CREATE TRIGGER "events_todo_guard" AFTER DELETE ON "billing"."events_todo" REFERENCING OLD TABLE AS om_deleted
    FOR EACH STATEMENT WHEN (current_setting('outbox_migrate.unpublished_guard', true) IS DISTINCT FROM 'off') EXECUTE
    FUNCTION "billing"."events_todo_guard"();
CREATE TRIGGER "events_todo_guard" AFTER DELETE ON "billing"."events_p" REFERENCING OLD TABLE AS om_deleted
    FOR EACH STATEMENT WHEN (current_setting('outbox_migrate.unpublished_guard', true) IS DISTINCT FROM 'off') EXECUTE
    FUNCTION "billing"."events_todo_guard"();
COMMIT;

-- step: hopia.v2.install-notify-trigger: Statement-level AFTER INSERT trigger on events_p waking an idle relay
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."events_p" IN SHARE ROW EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s is not partitioned by LIST (%s)', '"billing"."events_p"', 'published_at')
WHERE NOT EXISTS (
    SELECT 1
    FROM pg_partitioned_table pt
    JOIN pg_attribute a ON a.attrelid = pt.partrelid AND a.attnum = pt.partattrs[0]
    WHERE pt.partrelid = to_regclass('"billing"."events_p"') AND pt.partstrat = 'l' AND pt.partnatts = 1
      AND a.attname = 'published_at')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.install-notify-trigger [partitioned-by-list:events_p] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
CREATE OR REPLACE FUNCTION "billing"."events_p_relay_notify"() RETURNS trigger LANGUAGE plpgsql AS $om$
BEGIN
    -- an idle relay holds this lock exclusively: only then is a NOTIFY worth its
    -- commit-time cost; the key stands for this table's name (idle_lock_key in
    -- outbox_migrate/relay/notify.py)
    IF NOT pg_try_advisory_xact_lock_shared(-1337030615, 0) THEN
        PERFORM pg_notify(TG_ARGV[0], (SELECT min("id")::text FROM "new_rows"));
    END IF;
    RETURN NULL;
END
$om$;
CREATE TRIGGER "relay_notify" AFTER INSERT ON "billing"."events_p" REFERENCING NEW TABLE AS "new_rows"
    FOR EACH STATEMENT EXECUTE FUNCTION "billing"."events_p_relay_notify"('outbox_migrate_relay');
COMMIT;

-- step: hopia.v2.create-published-partition: Create events_done as the DEFAULT partition (every published row)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '10000ms';
LOCK TABLE ONLY "billing"."events_p" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."events_p"')
WHERE to_regclass('"billing"."events_p"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-published-partition [relation-exists:events_p] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"billing"."events_done"')
WHERE to_regclass('"billing"."events_done"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.create-published-partition [relation-absent:events_done] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
CREATE TABLE "billing"."events_done" PARTITION OF "billing"."events_p" DEFAULT;
DO $om$
DECLARE
    old_rel regclass := '"billing"."Events"'::regclass;
    new_rel regclass := '"billing"."events_done"'::regclass;
    wanted text[] := ARRAY[]::text[];
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"billing"."Events"'::regclass);
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

-- step: hopia.v2.tune-autovacuum: Insert-only autovacuum settings on events_done (every 100 k inserts)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."events_done" IN SHARE UPDATE EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."events_done"')
WHERE to_regclass('"billing"."events_done"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.tune-autovacuum [relation-exists:events_done] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "billing"."events_done" SET
    (autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 100000,
    autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 100000);
COMMIT;

-- step: hopia.v2.install-copy-trigger: AFTER INSERT trigger on events_done copying each published row to Events
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."events_done" IN SHARE ROW EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s is not attached to %s %s (found: %s)', '"billing"."events_done"', '"billing"."events_p"', 'DEFAULT',
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass('"billing"."events_done"')), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass('"billing"."events_done"') AND i.inhparent = to_regclass('"billing"."events_p"')
      AND pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.install-copy-trigger [partition-bound:events_done] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."Events"')
WHERE to_regclass('"billing"."Events"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.install-copy-trigger [relation-exists:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s holds rows; dropping it would lose them — move or publish them first', '"billing"."events_done"')
WHERE to_regclass('"billing"."events_done"') IS NOT NULL AND EXISTS (SELECT 1 FROM "billing"."events_done")
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.install-copy-trigger [relation-empty:events_done] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
CREATE OR REPLACE FUNCTION "billing"."events_done_insert_trigger"() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, "billing" AS $om$
BEGIN
    PERFORM set_config('outbox_migrate.copying', 'on', true);
    INSERT INTO "billing"."Events" OVERRIDING SYSTEM VALUE VALUES (NEW.*) ON CONFLICT DO NOTHING;
    PERFORM set_config('outbox_migrate.copying', 'off', true);
    RETURN NULL;
END
$om$;
CREATE TRIGGER "events_done_insert" AFTER INSERT ON "billing"."events_done"
    FOR EACH ROW EXECUTE FUNCTION "billing"."events_done_insert_trigger"();
COMMIT;

-- step: hopia.v2.install-gate-sequence: Sequence Events_gate_seq ticked by every INSERT statement into Events: what the
--   deploy gates watch (ids supplied or generated alike)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."Events" IN SHARE ROW EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."Events"')
WHERE to_regclass('"billing"."Events"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.install-gate-sequence [relation-exists:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"billing"."Events_gate_seq"')
WHERE to_regclass('"billing"."Events_gate_seq"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.install-gate-sequence [relation-absent:Events_gate_seq] failed: '
            '%', violation;
    END LOOP;
END
$om_assert$;
CREATE SEQUENCE "billing"."Events_gate_seq" AS bigint CACHE 1;
CREATE FUNCTION "billing"."Events_gate_tick"() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog AS $om$
BEGIN
    -- a writer's INSERT (also one made by the application's own triggers), not
    -- HOPIA's copy of a published row, which raises this flag around its INSERT
    IF coalesce(current_setting('outbox_migrate.copying', true), '') <> 'on' THEN
        PERFORM nextval('"billing"."Events_gate_seq"'::regclass);
        PERFORM pg_advisory_xact_lock_shared(hashtext('outbox-migrate.gate'), hashtext('"billing"."Events"'));
    END IF;
    RETURN NULL;
END
$om$;
CREATE TRIGGER "Events_gate_tick" AFTER INSERT ON "billing"."Events"
    FOR EACH STATEMENT EXECUTE FUNCTION "billing"."Events_gate_tick"();
COMMIT;

-- check: no publication lists Events without events_todo (CDC consumers)
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format(
        'publication %I lists %s but %s; apply the step publish-unpublished-partition from `outbox-migrate plan --dsn '
        '... --format sql` (or %s) before deploying V2',
              p.pubname, '"billing"."Events"',
              CASE WHEN NOT l.listed
                   THEN format('not %s: its consumer would miss every message V2 writes', '"billing"."events_todo"')
                   ELSE
                       format(
                       '%s has no REPLICA IDENTITY FULL: every mark of the V2 relay would fail (cannot update a table '
                       'that publishes updates without a replica identity)', '"billing"."events_todo"') END,
              concat_ws('; ',
                        CASE WHEN NOT l.full_identity THEN
                            format('ALTER TABLE %s REPLICA IDENTITY FULL', '"billing"."events_todo"') END,
                        CASE WHEN NOT l.listed THEN
                            format('ALTER PUBLICATION %I ADD TABLE %s', p.pubname, '"billing"."events_todo"') END))
FROM pg_publication p JOIN pg_publication_rel r ON r.prpubid = p.oid AND r.prrelid = to_regclass('"billing"."Events"')
CROSS JOIN LATERAL (
    SELECT EXISTS (SELECT 1 FROM pg_publication_rel u
                   WHERE u.prpubid = p.oid AND u.prrelid = to_regclass('"billing"."events_todo"')) AS listed,
           EXISTS (SELECT 1 FROM pg_class c
                   WHERE c.oid = to_regclass('"billing"."events_todo"') AND c.relreplident = 'f') AS full_identity) l
WHERE NOT l.listed OR ((p.pubupdate OR p.pubdelete) AND NOT l.full_identity)
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v2.install-gate-sequence (CDC) [publications-carried] failed: %',
            violation;
    END LOOP;
END
$om_assert$;

-- phase: V3
-- Run this phase's gate before deploying V3: no V1 is left and the old table is fully published.
-- V3 inserts into and publishes from the partitioned table only.

-- step: hopia.v3.gate-old-table-retired: Gate: no writer inserts into Events any more and it is fully published
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN -- The trigger of kinds/gate_sequence.py ticks the sequence when an insert statement ends and
-- holds a shared advisory lock until its transaction ends. Where the sequence stood is kept
-- in a session setting for `no-new-ticks-since-sample`.
WITH before AS MATERIALIZED (
    SELECT to_regclass('"billing"."Events_gate_seq"') AS oid,
        pg_sequence_last_value(to_regclass('"billing"."Events_gate_seq"')) AS value
), pause AS MATERIALIZED (
    SELECT pg_sleep(2.0) FROM before
), after_ AS MATERIALIZED (
    SELECT pg_sequence_last_value(before.oid) AS value,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"billing"."Events"')::int8 & 4294967295)) AS open_writers
    FROM before, pause
), after AS MATERIALIZED (
    SELECT after_.value, after_.open_writers,
           set_config('outbox_migrate.gate_46223f3c', coalesce(after_.value, 0)::text || ':ticks', false) AS saved
    FROM after_
)
SELECT CASE
    WHEN before.oid IS NULL
    THEN
        format('%s: the gate sequence %s is missing (the gates need the install-gate-sequence step of V2)',
        '"billing"."Events"', '"billing"."Events_gate_seq"')
    WHEN coalesce(after.value, 0) > coalesce(before.value, 0)
    THEN
        format(
        '%s is still receiving inserts: %s insert statements in %s s; phase %s needs every writer of the old version '
        'gone — is the rollout of the previous version finished?',
                '"billing"."Events"', coalesce(after.value, 0) - coalesce(before.value, 0), 2.0, 'V3')
    ELSE
        format(
        '%s: %s open transaction(s) inserted into it and have not ended; phase %s needs every writer of the old '
        'version gone',
                '"billing"."Events"', after.open_writers, 'V3') END
FROM before LEFT JOIN after ON true
WHERE before.oid IS NULL OR coalesce(after.value, 0) > coalesce(before.value, 0)
   OR after.open_writers > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v3.gate-old-table-retired [no-new-ticks:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."Events"')
WHERE to_regclass('"billing"."Events"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v3.gate-old-table-retired [relation-exists:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH saved AS MATERIALIZED (
    SELECT nullif(split_part(coalesce(current_setting('outbox_migrate.gate_46223f3c', true), ''), ':', 1), '')::bigint
        AS seq_last,
           coalesce(current_setting('outbox_migrate.gate_46223f3c', true), '') LIKE '%:ticks' AS sampled
), now_ AS MATERIALIZED (
    SELECT coalesce(pg_sequence_last_value(to_regclass('"billing"."Events_gate_seq"')), 0) AS seq_last,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"billing"."Events"')::int8 & 4294967295)) AS open_writers
)
SELECT CASE WHEN NOT saved.sampled
            THEN
                format(
                '%s: the gate did not sample this table in this session; phase %s needs its sampling window first',
                '"billing"."Events"', 'V3')
            WHEN now_.open_writers > 0
            THEN
                format(
                '%s: %s open transaction(s) inserted into it after the gate sampled; phase %s needs every writer of '
                'the old version gone', '"billing"."Events"', now_.open_writers, 'V3')
            ELSE
                format(
                '%s received inserts from a writer of the old version after the gate sampled (gate sequence at %s, '
                'was %s); phase %s needs every writer of the old version gone',
                        '"billing"."Events"', now_.seq_last, saved.seq_last, 'V3') END
FROM now_, saved
WHERE NOT saved.sampled OR now_.seq_last > coalesce(saved.seq_last, 0) OR now_.open_writers > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v3.gate-old-table-retired [no-new-ticks-since-sample:Events] '
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
              count(*), '"billing"."Events"', 'V3')
FROM "billing"."Events" WHERE "published_at" IS NULL
HAVING count(*) > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v3.gate-old-table-retired [old-table-drained:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;

-- phase: V4
-- Run this phase's steps once V3 is fully rolled out; V4 behaves like V3.
-- The swap is one short catalog-only transaction; every published row was already in the old table, so nothing
--   disappears from view.
-- Optionally drop the detached published partition afterwards: all its rows are in the old table.

-- step: hopia.v4.drop-identity: Drop IDENTITY from Events.id (a partition may not have one)
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN -- The trigger of kinds/gate_sequence.py ticks the sequence when an insert statement ends and
-- holds a shared advisory lock until its transaction ends. Where the sequence stood is kept
-- in a session setting for `no-new-ticks-since-sample`.
WITH before AS MATERIALIZED (
    SELECT to_regclass('"billing"."Events_gate_seq"') AS oid,
        pg_sequence_last_value(to_regclass('"billing"."Events_gate_seq"')) AS value
), pause AS MATERIALIZED (
    SELECT pg_sleep(2.0) FROM before
), after_ AS MATERIALIZED (
    SELECT pg_sequence_last_value(before.oid) AS value,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"billing"."Events"')::int8 & 4294967295)) AS open_writers
    FROM before, pause
), after AS MATERIALIZED (
    SELECT after_.value, after_.open_writers,
           set_config('outbox_migrate.gate_46223f3c', coalesce(after_.value, 0)::text || ':ticks', false) AS saved
    FROM after_
)
SELECT CASE
    WHEN before.oid IS NULL
    THEN
        format('%s: the gate sequence %s is missing (the gates need the install-gate-sequence step of V2)',
        '"billing"."Events"', '"billing"."Events_gate_seq"')
    WHEN coalesce(after.value, 0) > coalesce(before.value, 0)
    THEN
        format(
        '%s is still receiving inserts: %s insert statements in %s s; phase %s needs every writer of the old version '
        'gone — is the rollout of the previous version finished?',
                '"billing"."Events"', coalesce(after.value, 0) - coalesce(before.value, 0), 2.0, 'V4')
    ELSE
        format(
        '%s: %s open transaction(s) inserted into it and have not ended; phase %s needs every writer of the old '
        'version gone',
                '"billing"."Events"', after.open_writers, 'V4') END
FROM before LEFT JOIN after ON true
WHERE before.oid IS NULL OR coalesce(after.value, 0) > coalesce(before.value, 0)
   OR after.open_writers > 0
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.drop-identity [no-new-ticks:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."Events" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."Events"')
WHERE to_regclass('"billing"."Events"') IS NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.drop-identity [relation-exists:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH saved AS MATERIALIZED (
    SELECT nullif(split_part(coalesce(current_setting('outbox_migrate.gate_46223f3c', true), ''), ':', 1), '')::bigint
        AS seq_last,
           coalesce(current_setting('outbox_migrate.gate_46223f3c', true), '') LIKE '%:ticks' AS sampled
), now_ AS MATERIALIZED (
    SELECT coalesce(pg_sequence_last_value(to_regclass('"billing"."Events_gate_seq"')), 0) AS seq_last,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"billing"."Events"')::int8 & 4294967295)) AS open_writers
)
SELECT CASE WHEN NOT saved.sampled
            THEN
                format(
                '%s: the gate did not sample this table in this session; phase %s needs its sampling window first',
                '"billing"."Events"', 'V4')
            WHEN now_.open_writers > 0
            THEN
                format(
                '%s: %s open transaction(s) inserted into it after the gate sampled; phase %s needs every writer of '
                'the old version gone', '"billing"."Events"', now_.open_writers, 'V4')
            ELSE
                format(
                '%s received inserts from a writer of the old version after the gate sampled (gate sequence at %s, '
                'was %s); phase %s needs every writer of the old version gone',
                        '"billing"."Events"', now_.seq_last, saved.seq_last, 'V4') END
FROM now_, saved
WHERE NOT saved.sampled OR now_.seq_last > coalesce(saved.seq_last, 0) OR now_.open_writers > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v4.drop-identity [no-new-ticks-since-sample:Events] failed: %',
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
    WHERE s.seqrelid = pg_get_serial_sequence('"billing"."events_p"', 'id')::regclass
), old_top AS (
    SELECT greatest(
        (SELECT max("id") FROM "billing"."Events"),
        pg_sequence_last_value(
            coalesce(pg_get_serial_sequence('"billing"."Events"', 'id')::regclass,
            (SELECT d.refobjid::regclass FROM pg_attrdef ad JOIN pg_attribute a ON a.attrelid = ad.adrelid
            AND a.attnum = ad.adnum JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid
            AND d.refclassid = 'pg_class'::regclass JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S'
            WHERE ad.adrelid = to_regclass('"billing"."Events"') AND a.attname = 'id' LIMIT 1)))) AS top
)
SELECT format('the identity of %s will issue id %s but %s already reaches id %s; raise the START (id_headroom)',
              '"billing"."events_p"', coalesce(n.last + n.seqincrement, n.seqstart), '"billing"."Events"', o.top)
FROM new_seq n, old_top o
WHERE o.top IS NOT NULL AND coalesce(n.last + n.seqincrement, n.seqstart) <= o.top
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.drop-identity [new-ids-above-old] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "billing"."Events" ALTER COLUMN "id" DROP IDENTITY IF EXISTS;
COMMIT;

-- step: hopia.v4.add-not-valid-check: Add CHECK (published_at IS NOT NULL) NOT VALID to Events
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN -- The trigger of kinds/gate_sequence.py ticks the sequence when an insert statement ends and
-- holds a shared advisory lock until its transaction ends. Where the sequence stood is kept
-- in a session setting for `no-new-ticks-since-sample`.
WITH before AS MATERIALIZED (
    SELECT to_regclass('"billing"."Events_gate_seq"') AS oid,
        pg_sequence_last_value(to_regclass('"billing"."Events_gate_seq"')) AS value
), pause AS MATERIALIZED (
    SELECT pg_sleep(2.0) FROM before
), after_ AS MATERIALIZED (
    SELECT pg_sequence_last_value(before.oid) AS value,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"billing"."Events"')::int8 & 4294967295)) AS open_writers
    FROM before, pause
), after AS MATERIALIZED (
    SELECT after_.value, after_.open_writers,
           set_config('outbox_migrate.gate_46223f3c', coalesce(after_.value, 0)::text || ':ticks', false) AS saved
    FROM after_
)
SELECT CASE
    WHEN before.oid IS NULL
    THEN
        format('%s: the gate sequence %s is missing (the gates need the install-gate-sequence step of V2)',
        '"billing"."Events"', '"billing"."Events_gate_seq"')
    WHEN coalesce(after.value, 0) > coalesce(before.value, 0)
    THEN
        format(
        '%s is still receiving inserts: %s insert statements in %s s; phase %s needs every writer of the old version '
        'gone — is the rollout of the previous version finished?',
                '"billing"."Events"', coalesce(after.value, 0) - coalesce(before.value, 0), 2.0, 'V4')
    ELSE
        format(
        '%s: %s open transaction(s) inserted into it and have not ended; phase %s needs every writer of the old '
        'version gone',
                '"billing"."Events"', after.open_writers, 'V4') END
FROM before LEFT JOIN after ON true
WHERE before.oid IS NULL OR coalesce(after.value, 0) > coalesce(before.value, 0)
   OR after.open_writers > 0
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.add-not-valid-check [no-new-ticks:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."Events" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH saved AS MATERIALIZED (
    SELECT nullif(split_part(coalesce(current_setting('outbox_migrate.gate_46223f3c', true), ''), ':', 1), '')::bigint
        AS seq_last,
           coalesce(current_setting('outbox_migrate.gate_46223f3c', true), '') LIKE '%:ticks' AS sampled
), now_ AS MATERIALIZED (
    SELECT coalesce(pg_sequence_last_value(to_regclass('"billing"."Events_gate_seq"')), 0) AS seq_last,
           (SELECT count(DISTINCT l.pid) FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid <> pg_backend_pid()
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('outbox-migrate.gate')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext('"billing"."Events"')::int8 & 4294967295)) AS open_writers
)
SELECT CASE WHEN NOT saved.sampled
            THEN
                format(
                '%s: the gate did not sample this table in this session; phase %s needs its sampling window first',
                '"billing"."Events"', 'V4')
            WHEN now_.open_writers > 0
            THEN
                format(
                '%s: %s open transaction(s) inserted into it after the gate sampled; phase %s needs every writer of '
                'the old version gone', '"billing"."Events"', now_.open_writers, 'V4')
            ELSE
                format(
                '%s received inserts from a writer of the old version after the gate sampled (gate sequence at %s, '
                'was %s); phase %s needs every writer of the old version gone',
                        '"billing"."Events"', now_.seq_last, saved.seq_last, 'V4') END
FROM now_, saved
WHERE NOT saved.sampled OR now_.seq_last > coalesce(saved.seq_last, 0) OR now_.open_writers > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v4.add-not-valid-check [no-new-ticks-since-sample:Events] failed: %',
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
              count(*), '"billing"."Events"', 'V4')
FROM "billing"."Events" WHERE "published_at" IS NULL
HAVING count(*) > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v4.add-not-valid-check [old-table-drained:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "billing"."Events" ADD CONSTRAINT "Events_published_check" CHECK ("published_at" IS NOT NULL) NOT VALID;
COMMIT;

-- step: hopia.v4.remove-gate-sequence: Drop the gate trigger and Events_gate_seq: the last deploy gate passed
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."Events" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."Events"')
WHERE to_regclass('"billing"."Events"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v4.remove-gate-sequence [relation-exists:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DROP TRIGGER IF EXISTS "Events_gate_tick" ON "billing"."Events";
DROP FUNCTION IF EXISTS "billing"."Events_gate_tick"();
DROP SEQUENCE IF EXISTS "billing"."Events_gate_seq";
COMMIT;

-- step: hopia.v4.validate-check: VALIDATE the CHECK on Events in its own transaction
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '0ms';
LOCK TABLE ONLY "billing"."Events" IN SHARE UPDATE EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('CHECK constraint %I is missing on %s', 'Events_published_check', '"billing"."Events"')
WHERE NOT EXISTS (
    SELECT 1 FROM pg_constraint
    WHERE conrelid = to_regclass('"billing"."Events"') AND conname = 'Events_published_check' AND contype = 'c')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.validate-check [check-exists] failed: %', violation;
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
              count(*), '"billing"."Events"', 'V4')
FROM "billing"."Events" WHERE "published_at" IS NULL
HAVING count(*) > 0
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.validate-check [old-table-drained:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "billing"."Events" VALIDATE CONSTRAINT "Events_published_check";
COMMIT;

-- step: hopia.v4.set-not-null: Optional: SET NOT NULL on Events.published_at, proven by the validated CHECK
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '1000ms';
LOCK TABLE ONLY "billing"."Events" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('CHECK constraint %I is missing on %s', 'Events_published_check', '"billing"."Events"')
WHERE NOT EXISTS (
    SELECT 1 FROM pg_constraint
    WHERE conrelid = to_regclass('"billing"."Events"') AND conname = 'Events_published_check' AND contype = 'c')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.set-not-null [check-exists] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('CHECK constraint %I on %s is NOT VALID; run its VALIDATE step first', 'Events_published_check',
        '"billing"."Events"')
FROM pg_constraint
WHERE conrelid = to_regclass('"billing"."Events"') AND conname = 'Events_published_check' AND NOT convalidated
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.set-not-null [check-validated] failed: %', violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "billing"."Events" ALTER COLUMN "published_at" SET NOT NULL;
COMMIT;

-- step: hopia.v4.disable-old-triggers: Optional: disable the user triggers of Events before it becomes a partition
--   (they would fire on every publish)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."Events" IN SHARE ROW EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."Events"')
WHERE to_regclass('"billing"."Events"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v4.disable-old-triggers [relation-exists:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "billing"."Events" DISABLE TRIGGER USER;
COMMIT;

-- step: hopia.v4.swap-default: In one transaction: DETACH events_done and ATTACH Events as DEFAULT
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s rows of %s are missing from %s (ids %s..%s); copy them before dropping the source',
              count(*), '"billing"."events_done"', '"billing"."Events"', min(s."id"), max(s."id"))
FROM "billing"."events_done" s
WHERE NOT EXISTS (SELECT 1 FROM "billing"."Events" t WHERE t."id" = s."id")
HAVING count(*) > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v4.swap-default [all-rows-present:events_done->Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '1000ms';
LOCK TABLE ONLY "billing"."events_p" IN ACCESS EXCLUSIVE MODE;
LOCK TABLE ONLY "billing"."events_done" IN ACCESS EXCLUSIVE MODE;
LOCK TABLE ONLY "billing"."Events" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s is not attached to %s %s (found: %s)', '"billing"."events_done"', '"billing"."events_p"', 'DEFAULT',
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass('"billing"."events_done"')), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass('"billing"."events_done"') AND i.inhparent = to_regclass('"billing"."events_p"')
      AND pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [partition-bound:events_done] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."events_p"')
WHERE to_regclass('"billing"."events_p"') IS NULL
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [relation-exists:events_p] failed: %',
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
WHERE c.oid = to_regclass('"billing"."Events"') AND (c.relkind <> 'r' OR c.relispartition)
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [is-plain-table:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('CHECK constraint %I is missing on %s', 'Events_published_check', '"billing"."Events"')
WHERE NOT EXISTS (
    SELECT 1 FROM pg_constraint
    WHERE conrelid = to_regclass('"billing"."Events"') AND conname = 'Events_published_check' AND contype = 'c')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [check-exists] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('CHECK constraint %I on %s is NOT VALID; run its VALIDATE step first', 'Events_published_check',
        '"billing"."Events"')
FROM pg_constraint
WHERE conrelid = to_regclass('"billing"."Events"') AND conname = 'Events_published_check' AND NOT convalidated
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [check-validated] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('CHECK constraint %I on %s is %s, which does not prove %I IS NOT NULL; ATTACH would scan the table',
              conname, '"billing"."Events"', pg_get_constraintdef(oid), 'published_at')
FROM pg_constraint
WHERE conrelid = to_regclass('"billing"."Events"') AND conname = 'Events_published_check'
  AND pg_get_constraintdef(oid) <> format('CHECK ((%I IS NOT NULL))', 'published_at')
  AND pg_get_constraintdef(oid) <> format('CHECK ((%I IS NOT NULL)) NOT VALID', 'published_at')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v4.swap-default [check-implies-partition-constraint] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH parent AS (
    SELECT attname, atttypid, atttypmod, attcollation, attnotnull
    FROM pg_attribute WHERE attrelid = to_regclass('"billing"."events_p"') AND attnum > 0 AND NOT attisdropped
), child AS (
    SELECT attname, atttypid, atttypmod, attcollation, attnotnull
    FROM pg_attribute WHERE attrelid = to_regclass('"billing"."Events"') AND attnum > 0 AND NOT attisdropped
)
SELECT format('column %I differs: %s has %s, %s has %s', coalesce(p.attname, c.attname),
              '"billing"."events_p"',
                  coalesce(format_type(p.atttypid, p.atttypmod) || CASE WHEN p.attnotnull THEN ' NOT NULL' ELSE '' END,
                  'no such column'),
              '"billing"."Events"',
                  coalesce(format_type(c.atttypid, c.atttypmod) || CASE WHEN c.attnotnull THEN ' NOT NULL' ELSE '' END,
                  'no such column'))
FROM parent p FULL JOIN child c ON c.attname = p.attname
WHERE p.attname IS NULL OR c.attname IS NULL
   OR p.atttypid <> c.atttypid OR p.atttypmod <> c.atttypmod OR p.attcollation <> c.attcollation
   OR (p.attnotnull AND NOT c.attnotnull)
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [columns-match:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s.%I is still an identity column; a partition may not have one', '"billing"."Events"', 'id')
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
WHERE a.attrelid = to_regclass('"billing"."Events"') AND a.attname = 'id' AND a.attidentity <> ''
  AND NOT c.relispartition
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [no-identity:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('foreign key %I on %s references %s; drop it or point it elsewhere before migrating',
              conname, conrelid::regclass, '"billing"."Events"')
FROM pg_constraint
WHERE contype = 'f' AND confrelid = to_regclass('"billing"."Events"')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [no-fk-references:Events] failed: %',
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
WHERE o.tgrelid = to_regclass('"billing"."Events"') AND p.tgrelid = to_regclass('"billing"."events_p"')
  AND (p.tgtype & 1) = 1 AND NOT p.tgisinternal AND o.tgparentid <> p.oid
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [no-trigger-name-clash] failed: %',
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
    WHERE s.seqrelid = pg_get_serial_sequence('"billing"."events_p"', 'id')::regclass
), old_top AS (
    SELECT greatest(
        (SELECT max("id") FROM "billing"."Events"),
        pg_sequence_last_value(
            coalesce(pg_get_serial_sequence('"billing"."Events"', 'id')::regclass,
            (SELECT d.refobjid::regclass FROM pg_attrdef ad JOIN pg_attribute a ON a.attrelid = ad.adrelid
            AND a.attnum = ad.adnum JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid
            AND d.refclassid = 'pg_class'::regclass JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S'
            WHERE ad.adrelid = to_regclass('"billing"."Events"') AND a.attname = 'id' LIMIT 1)))) AS top
)
SELECT format('the identity of %s will issue id %s but %s already reaches id %s; raise the START (id_headroom)',
              '"billing"."events_p"', coalesce(n.last + n.seqincrement, n.seqstart), '"billing"."Events"', o.top)
FROM new_seq n, old_top o
WHERE o.top IS NOT NULL AND coalesce(n.last + n.seqincrement, n.seqstart) <= o.top
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [new-ids-above-old] failed: %',
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
              count(*), '"billing"."Events"', 'V4')
FROM "billing"."Events" WHERE "published_at" IS NULL
HAVING count(*) > 0
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [old-table-drained:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('trigger %I on %s is missing or disabled', 'events_done_insert', '"billing"."events_done"')
WHERE NOT EXISTS (
    SELECT 1 FROM pg_trigger
    WHERE tgrelid = to_regclass('"billing"."events_done"') AND tgname = 'events_done_insert' AND tgenabled <> 'D')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.swap-default [trigger-exists] failed: %', violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "billing"."events_p" DETACH PARTITION "billing"."events_done";
ALTER TABLE "billing"."events_p" ATTACH PARTITION "billing"."Events" DEFAULT;
COMMIT;

-- step: hopia.v4.drop-check: Drop the now-redundant CHECK from Events (the partition bound says it)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."Events" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s is not attached to %s %s (found: %s)', '"billing"."Events"', '"billing"."events_p"', 'DEFAULT',
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass('"billing"."Events"')), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass('"billing"."Events"') AND i.inhparent = to_regclass('"billing"."events_p"')
      AND pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT')
    LOOP
        RAISE EXCEPTION 'outbox-migrate: precondition of hopia.v4.drop-check [partition-bound:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "billing"."Events" DROP CONSTRAINT IF EXISTS "Events_published_check";
COMMIT;

-- step: hopia.v4.remove-copy-trigger: Drop the copy trigger and its function (events_done is detached now)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."events_done" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s is still a partition of %s', '"billing"."events_done"', '"billing"."events_p"')
FROM pg_inherits i
WHERE i.inhrelid = to_regclass('"billing"."events_done"') AND i.inhparent = to_regclass('"billing"."events_p"')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v4.remove-copy-trigger [not-a-partition-of:events_done] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DROP TRIGGER IF EXISTS "events_done_insert" ON "billing"."events_done";
DROP FUNCTION IF EXISTS "billing"."events_done_insert_trigger"();
COMMIT;

-- step: hopia.v4.tune-autovacuum-old: Insert-only autovacuum settings on Events (every 100 k inserts)
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."Events" IN SHARE UPDATE EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."Events"')
WHERE to_regclass('"billing"."Events"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v4.tune-autovacuum-old [relation-exists:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "billing"."Events" SET
    (autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 100000,
    autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 100000);
COMMIT;

-- step: hopia.v4.drop-detached-published: Drop the detached events_done: every row of it is in Events
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s rows of %s are missing from %s (ids %s..%s); copy them before dropping the source',
              count(*), '"billing"."events_done"', '"billing"."Events"', min(s."id"), max(s."id"))
FROM "billing"."events_done" s
WHERE NOT EXISTS (SELECT 1 FROM "billing"."Events" t WHERE t."id" = s."id")
HAVING count(*) > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v4.drop-detached-published [all-rows-present:events_done->Events] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."events_done" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s is still a partition of %s', '"billing"."events_done"', '"billing"."events_p"')
FROM pg_inherits i
WHERE i.inhrelid = to_regclass('"billing"."events_done"') AND i.inhparent = to_regclass('"billing"."events_p"')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.v4.drop-detached-published [not-a-partition-of:events_done] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DROP TABLE "billing"."events_done";
COMMIT;

-- phase: original-name
-- Optional (plan/run --with-optional): for frameworks with a fixed outbox table name.
-- Run this phase's step while the previous version runs: in one short catalog-only transaction the old table, now the
--   DEFAULT partition, takes the published partition's name, the partitioned table takes the original name, and a view
--   under its former name keeps the previous version's inserts (and a relay started with the former name) working.
-- Then deploy the version that inserts into and publishes from the original name (relay: --partitioned-table with the
--   original name, and --table with the original name and _retired: the flat-table option must not name the same
--   table).

-- step: hopia.original-name.take-original-name: In one transaction: Events (the DEFAULT partition) becomes events_done,
--   events_p becomes Events, and a view events_p over it keeps the previous version's inserts working
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."Events" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s does not exist; check the schema and table names (outbox-migrate config)', '"billing"."events_p"')
WHERE to_regclass('"billing"."events_p"') IS NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.original-name.take-original-name [relation-exists:events_p] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('%s is not partitioned by LIST (%s)', '"billing"."events_p"', 'published_at')
WHERE NOT EXISTS (
    SELECT 1
    FROM pg_partitioned_table pt
    JOIN pg_attribute a ON a.attrelid = pt.partrelid AND a.attnum = pt.partattrs[0]
    WHERE pt.partrelid = to_regclass('"billing"."events_p"') AND pt.partstrat = 'l' AND pt.partnatts = 1
      AND a.attname = 'published_at')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.original-name.take-original-name [partitioned-by-list:events_p] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s is not attached to %s %s (found: %s)', '"billing"."events_todo"', '"billing"."events_p"',
        'FOR VALUES IN (NULL)',
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass('"billing"."events_todo"')), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass('"billing"."events_todo"') AND i.inhparent = to_regclass('"billing"."events_p"')
      AND pg_get_expr(c.relpartbound, c.oid) = 'FOR VALUES IN (NULL)')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.original-name.take-original-name [partition-bound:events_todo] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"billing"."events_done"')
WHERE to_regclass('"billing"."events_done"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.original-name.take-original-name [relation-absent:events_done] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s is not attached to %s %s (found: %s)', '"billing"."Events"', '"billing"."events_p"', 'DEFAULT',
              coalesce((SELECT i.inhparent::regclass::text || ' ' || pg_get_expr(c.relpartbound, c.oid)
                        FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
                        WHERE c.oid = to_regclass('"billing"."Events"')), 'not a partition'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid
    WHERE c.oid = to_regclass('"billing"."Events"') AND i.inhparent = to_regclass('"billing"."events_p"')
      AND pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT')
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.original-name.take-original-name [partition-bound:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format(
        '%s unpublished row(s) in %s, which no relay reads in phase %s: a writer of a version that must not run now '
        'inserted them (or the rename to the original name was rolled back under it) — publish them with '
        '`outbox-migrate relay --mode flat --until-empty --table %s` and the same sink, stop that writer, then run '
        'this again',
              t.n, t.rel, 'original-name', t.rel)
FROM (
    SELECT c.oid::regclass AS rel,
           substring(
               query_to_xml(format('SELECT count(*) AS n FROM %s WHERE %s', c.oid::regclass, '"published_at" IS NULL'),
                                  false, true, '')::text FROM '<n>(\d+)</n>')::int8 AS n
    FROM pg_class c
    WHERE c.oid IN (to_regclass('"billing"."Events"'), to_regclass('"billing"."Events_retired"'))
      AND c.relkind = 'r' AND NOT c.relispartition
) t
WHERE t.n > 0
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.original-name.take-original-name [no-unread-rows:Events] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
ALTER TABLE "billing"."Events" RENAME TO "events_done";
ALTER TABLE "billing"."events_p" RENAME TO "Events";
CREATE VIEW "billing"."events_p" AS SELECT *, ctid, tableoid FROM "billing"."Events";
DO $om$
DECLARE
    old_rel regclass := '"billing"."Events"'::regclass;
    new_rel regclass := '"billing"."events_p"'::regclass;
    wanted text[] := NULL::text[];
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"billing"."Events"'::regclass);
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
DO $rekey$
BEGIN
    IF to_regprocedure('"billing"."events_p_relay_notify"()') IS NOT NULL THEN
        EXECUTE
            'CREATE OR REPLACE FUNCTION "billing"."events_p_relay_notify"() RETURNS trigger LANGUAGE plpgsql AS $om$' ||
            chr(10)
            || 'BEGIN' || chr(10)
            || '    -- an idle relay holds this lock exclusively: only then is a NOTIFY worth its' || chr(10)
            || '    -- commit-time cost; the key stands for this table''s name (idle_lock_key in' || chr(10)
            || '    -- outbox_migrate/relay/notify.py)' || chr(10)
            || '    IF NOT pg_try_advisory_xact_lock_shared(-2022672750, 0) THEN' || chr(10)
            || '        PERFORM pg_notify(TG_ARGV[0], (SELECT min("id")::text FROM "new_rows"));' || chr(10)
            || '    END IF;' || chr(10)
            || '    RETURN NULL;' || chr(10)
            || 'END' || chr(10)
            || '$om$';
    END IF;
END
$rekey$;
COMMIT;

-- phase: drop-view
-- Run this phase once the version that uses the original name is fully rolled out: it counts every write through the
--   view, and its gate drops the view once no write went through it during the window and no session holds it (with
--   --old-app-name, once no session of the previous version is connected).

-- step: hopia.drop-view.count-view-writes: Count every write through the view events_p: rules tick events_p_view_uses
--   once per statement, the drop gate's evidence
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."events_p" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format(
        '%s is not a view over %s (found: %s); the original-name step did not run, or the name was taken by hand — '
        'inspect it',
              '"billing"."events_p"', '"billing"."Events"',
              coalesce((SELECT CASE c.relkind WHEN 'v' THEN 'a view over other relations'
                                               WHEN 'p' THEN 'a partitioned table'
                                               WHEN 'r' THEN 'a table'
                                               ELSE 'relkind ' || c.relkind::text END
                        FROM pg_class c WHERE c.oid = to_regclass('"billing"."events_p"')), 'nothing'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class v
    JOIN pg_rewrite r ON r.ev_class = v.oid
    JOIN pg_depend d ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid
                    AND d.refclassid = 'pg_class'::regclass
    WHERE v.oid = to_regclass('"billing"."events_p"') AND v.relkind = 'v'
      AND d.refobjid = to_regclass('"billing"."Events"'))
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.drop-view.count-view-writes [view-over:events_p] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"billing"."events_p_view_uses"')
WHERE to_regclass('"billing"."events_p_view_uses"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.drop-view.count-view-writes [relation-absent:events_p_view_uses] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT format('function %s still exists', '"billing"."events_p_view_use_tick"')
WHERE to_regproc('"billing"."events_p_view_use_tick"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.drop-view.count-view-writes '
            '[function-absent:events_p_view_use_tick] failed: %', violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format('%s already exists; was this step applied by hand? inspect it, or reset the ledger',
        '"billing"."events_p_view_use_sink"')
WHERE to_regclass('"billing"."events_p_view_use_sink"') IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.drop-view.count-view-writes '
            '[relation-absent:events_p_view_use_sink] failed: %', violation;
    END LOOP;
END
$om_assert$;
CREATE SEQUENCE "billing"."events_p_view_uses" AS bigint CACHE 1;
CREATE FUNCTION "billing"."events_p_view_use_tick"() RETURNS boolean LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path = pg_catalog AS $om$
BEGIN
    PERFORM nextval('"billing"."events_p_view_uses"'::regclass);
    RETURN false;
END
$om$;
GRANT EXECUTE ON FUNCTION "billing"."events_p_view_use_tick"() TO PUBLIC;
CREATE TABLE "billing"."events_p_view_use_sink" ();
DO $om$
DECLARE
    old_rel regclass := '"billing"."Events"'::regclass;
    new_rel regclass := '"billing"."events_p_view_use_sink"'::regclass;
    wanted text[] := ARRAY[]::text[];
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = '"billing"."Events"'::regclass);
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
CREATE RULE "count_inserts" AS ON INSERT TO "billing"."events_p" DO ALSO INSERT INTO "billing"."events_p_view_use_sink"
    SELECT WHERE "billing"."events_p_view_use_tick"();
CREATE RULE "count_updates" AS ON UPDATE TO "billing"."events_p" DO ALSO INSERT INTO "billing"."events_p_view_use_sink"
    SELECT WHERE "billing"."events_p_view_use_tick"();
CREATE RULE "count_deletes" AS ON DELETE TO "billing"."events_p" DO ALSO INSERT INTO "billing"."events_p_view_use_sink"
    SELECT WHERE "billing"."events_p_view_use_tick"();
COMMIT;

-- step: hopia.drop-view.drop-compat-view: Gate and drop: no write went through the view events_p during the window and
--   nobody holds it; drop it and its use counter
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN -- The counter is read before and after the window; where it stood is kept in a session
-- setting for `no-view-writes-since-sample`, checked under the step's lock.
WITH before AS MATERIALIZED (
    SELECT to_regclass('"billing"."events_p_view_uses"') AS oid,
           coalesce(has_sequence_privilege(to_regclass('"billing"."events_p_view_uses"'), 'SELECT'), false) AS readable,
           coalesce(CASE WHEN has_sequence_privilege(to_regclass('"billing"."events_p_view_uses"'), 'SELECT')
                         THEN pg_sequence_last_value(to_regclass('"billing"."events_p_view_uses"')) END, 0) AS value
), samples AS MATERIALIZED (
    SELECT g, u.pids
    FROM before
    CROSS JOIN generate_series(1, 20) g
    -- both laterals name g (and the pause names before): evaluated per sample, after before
    CROSS JOIN LATERAL (SELECT pg_sleep(0.1) WHERE g > 0 AND before.value >= 0) pause
    CROSS JOIN LATERAL (
        SELECT string_agg(DISTINCT l.pid::text, ',') AS pids
        FROM pg_locks l
        WHERE l.locktype = 'relation' AND l.relation = to_regclass('"billing"."events_p"')
          AND l.pid <> pg_backend_pid() AND g > 0
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    ) u
), seen AS MATERIALIZED (
    SELECT string_agg(DISTINCT samples.pids, ',') AS pids FROM samples
), after AS MATERIALIZED (
    SELECT v.value, seen.pids, set_config('outbox_migrate.view_a9c89a39', v.value::text, false) AS saved
    FROM before, seen,
         -- names seen: read after the window, not before it
         LATERAL (SELECT coalesce(CASE WHEN before.readable
                                       THEN pg_sequence_last_value(before.oid) END, 0) AS value,
                         seen.pids AS after_window) v
)
SELECT CASE
    WHEN before.oid IS NULL
    THEN
        format('%s has no use counter (%s is missing); the count-view-writes step of phase %s must run first',
        '"billing"."events_p"', '"billing"."events_p_view_uses"', 'drop-view')
    WHEN NOT before.readable
    THEN
        format(
        '%s: role %s cannot read the use counter %s (a gate does not pass on what it cannot see); run as the role '
        'that ran count-view-writes, or GRANT SELECT ON SEQUENCE %s TO %s', '"billing"."events_p"', current_user,
        '"billing"."events_p_view_uses"', '"billing"."events_p_view_uses"', current_user)
    WHEN after.value > before.value
    THEN
        format(
        '%s is still written through: %s statements in %s s; phase %s needs every instance of the previous version '
        '(which writes to %s) gone — finish the rollout, then run this phase again',
                '"billing"."events_p"', after.value - before.value, 2.0, 'drop-view', '"billing"."events_p"')
    ELSE
        format(
        '%s is still used by other sessions (pids %s) during the %s s window; phase %s needs every instance of the '
        'previous version (which writes to %s) gone — finish the rollout, then run this phase again',
                '"billing"."events_p"', after.pids, 2.0, 'drop-view', '"billing"."events_p"') END
FROM before, after
WHERE before.oid IS NULL OR NOT before.readable OR after.value > before.value
   OR after.pids IS NOT NULL
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.drop-view.drop-compat-view [no-view-users:events_p] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
BEGIN;
SET LOCAL lock_timeout = '200ms';
SET LOCAL statement_timeout = '2000ms';
LOCK TABLE ONLY "billing"."events_p" IN ACCESS EXCLUSIVE MODE;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN SELECT
        format(
        '%s is not a view over %s (found: %s); the original-name step did not run, or the name was taken by hand — '
        'inspect it',
              '"billing"."events_p"', '"billing"."Events"',
              coalesce((SELECT CASE c.relkind WHEN 'v' THEN 'a view over other relations'
                                               WHEN 'p' THEN 'a partitioned table'
                                               WHEN 'r' THEN 'a table'
                                               ELSE 'relkind ' || c.relkind::text END
                        FROM pg_class c WHERE c.oid = to_regclass('"billing"."events_p"')), 'nothing'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class v
    JOIN pg_rewrite r ON r.ev_class = v.oid
    JOIN pg_depend d ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid
                    AND d.refclassid = 'pg_class'::regclass
    WHERE v.oid = to_regclass('"billing"."events_p"') AND v.relkind = 'v'
      AND d.refobjid = to_regclass('"billing"."Events"'))
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.drop-view.drop-compat-view [view-over:events_p] failed: %',
            violation;
    END LOOP;
END
$om_assert$;
DO $om_assert$
DECLARE violation text;
BEGIN
    FOR violation IN WITH saved AS MATERIALIZED (
    SELECT nullif(coalesce(current_setting('outbox_migrate.view_a9c89a39', true), ''), '')::bigint AS value
), now_ AS MATERIALIZED (
    SELECT coalesce(CASE WHEN has_sequence_privilege(to_regclass('"billing"."events_p_view_uses"'), 'SELECT')
                         THEN pg_sequence_last_value(to_regclass('"billing"."events_p_view_uses"')) END, 0) AS value,
           coalesce(has_sequence_privilege(to_regclass('"billing"."events_p_view_uses"'), 'SELECT'), false) AS readable
)
SELECT CASE WHEN NOT now_.readable
            THEN
                format(
                '%s: role %s cannot read the use counter %s; run as the role that ran count-view-writes, or GRANT '
                'SELECT ON SEQUENCE %s TO %s', '"billing"."events_p"', current_user, '"billing"."events_p_view_uses"',
                '"billing"."events_p_view_uses"', current_user)
            WHEN saved.value IS NULL
            THEN
                format('%s: the gate did not sample the view in this session; phase %s needs its sampling window first',
                '"billing"."events_p"', 'drop-view')
            ELSE
                format(
                '%s was written through after the gate sampled (use counter at %s, was %s); phase %s needs every '
                'instance of the previous version (which writes to %s) gone',
                        '"billing"."events_p"', now_.value, saved.value, 'drop-view', '"billing"."events_p"') END
FROM saved, now_
WHERE NOT now_.readable OR saved.value IS NULL OR now_.value > saved.value
    LOOP
        RAISE EXCEPTION
            'outbox-migrate: precondition of hopia.drop-view.drop-compat-view [no-view-writes-since-sample:events_p] '
            'failed: %', violation;
    END LOOP;
END
$om_assert$;
DROP VIEW "billing"."events_p";
DROP TABLE "billing"."events_p_view_use_sink";
DROP FUNCTION "billing"."events_p_view_use_tick"();
DROP SEQUENCE "billing"."events_p_view_uses";
COMMIT;
