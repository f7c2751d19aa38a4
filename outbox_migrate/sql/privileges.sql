-- Privileges: what the relations a migration creates must carry over from the old table, and
-- how `plan` reads it. Placeholders as in conditions.sql (*_reg: text literals of quoted names).

-- name: carry-privileges
-- Give the new relation the old table's grants (the privilege types wanted; NULL: all), then its owner.
DO $om$
DECLARE
    old_rel regclass := {old_reg}::regclass;
    new_rel regclass := {new_reg}::regclass;
    wanted text[] := {wanted};
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = {old_reg}::regclass);
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
$om$

-- name: table-grants
-- The old table's owner, and every table and column grant to another role (grantee, privilege, column or NULL, grantable).
SELECT c.relowner::regrole::text AS owner,
       CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END AS grantee,
       g.privilege_type, g.col, g.is_grantable
FROM pg_class c
LEFT JOIN LATERAL (
    SELECT a.grantee, a.privilege_type, NULL::text AS col, a.is_grantable
    FROM aclexplode(c.relacl) a
    UNION ALL
    SELECT a.grantee, a.privilege_type, t.attname::text, a.is_grantable
    FROM pg_attribute t, aclexplode(t.attacl) a
    WHERE t.attrelid = c.oid AND t.attnum > 0 AND NOT t.attisdropped
) g ON g.grantee <> c.relowner
WHERE c.oid = to_regclass({rel_reg})
ORDER BY 2, 4 NULLS FIRST, 3

-- name: row-security
-- Whether row-level security is enabled on the table, and how many policies it has.
SELECT c.relrowsecurity, (SELECT count(*) FROM pg_policy p WHERE p.polrelid = c.oid)
FROM pg_class c
WHERE c.oid = to_regclass({rel_reg})

-- name: grant-dead-letters
-- Give the relay's roles (those with UPDATE on the old table: they mark) what dead-lettering needs.
DO $om$
DECLARE
    old_rel regclass := {old_reg}::regclass;
    old_owner oid := (SELECT relowner FROM pg_class WHERE oid = {old_reg}::regclass);
    g record;
    t regclass;
BEGIN
    FOR g IN
        SELECT DISTINCT a.grantee
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = old_rel AND a.grantee <> old_owner AND a.privilege_type = 'UPDATE'
    LOOP
        FOREACH t IN ARRAY ARRAY[{dead_reg}::regclass, {attempts_reg}::regclass] LOOP
            EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE %s TO %s', t,
                CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END);
        END LOOP;
        EXECUTE format('GRANT DELETE ON TABLE %s TO %s', {unpublished_reg}::regclass,
            CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END);
    END LOOP;
END
$om$

-- name: role-facts
-- What a role is and may do beyond table grants (%(role)s, %(relation)s: text; NULL when the role does not exist): superuser, REPLICATION, sees other roles' sessions, owns the outbox, USAGE and CREATE on its schema, CREATE on the database, CREATE on the ledger schema (NULL: not created yet).
SELECT r.rolsuper, r.rolreplication,
       r.rolsuper OR pg_has_role(r.oid, 'pg_read_all_stats'::name, 'USAGE'),
       r.rolsuper OR pg_has_role(r.oid, c.relowner, 'USAGE'),
       has_schema_privilege(r.oid, c.relnamespace, 'USAGE'),
       has_schema_privilege(r.oid, c.relnamespace, 'CREATE'),
       has_database_privilege(r.oid, current_database(), 'CREATE'),
       (SELECT has_schema_privilege(r.oid, s.oid, 'CREATE')
        FROM pg_namespace s WHERE s.nspname = %(ledger)s::name),
       c.relowner::regrole::text
FROM pg_class c LEFT JOIN pg_roles r ON r.rolname = %(role)s::name
WHERE c.oid = %(relation)s::regclass

-- name: publication
-- The CDC relay's publication (%(publication)s): whether it exists and whether %(role)s may alter and comment it (a member of its owner).
SELECT pg_has_role(%(role)s::name, p.pubowner, 'USAGE') FROM pg_publication p WHERE p.pubname = %(publication)s
