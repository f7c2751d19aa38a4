-- Conditions of the optional last phases that give the partitioned outbox the flat table's
-- original name (patterns/kinds/original_name.py). Same contract as conditions.sql: one text
-- row per violation, no rows when the condition holds; messages say what to do.

-- name: view-over
-- The relation is a view that reads the table (the previous version's name, kept for its writers).
SELECT format('%s is not a view over %s (found: %s); the original-name step did not run, or the name was taken by hand — inspect it',
              {view_reg}, {rel_reg},
              coalesce((SELECT CASE c.relkind WHEN 'v' THEN 'a view over other relations'
                                               WHEN 'p' THEN 'a partitioned table'
                                               WHEN 'r' THEN 'a table'
                                               ELSE 'relkind ' || c.relkind::text END
                        FROM pg_class c WHERE c.oid = to_regclass({view_reg})), 'nothing'))
WHERE NOT EXISTS (
    SELECT 1 FROM pg_class v
    JOIN pg_rewrite r ON r.ev_class = v.oid
    JOIN pg_depend d ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid
                    AND d.refclassid = 'pg_class'::regclass
    WHERE v.oid = to_regclass({view_reg}) AND v.relkind = 'v'
      AND d.refobjid = to_regclass({rel_reg}))

-- name: no-view-users
-- No other session used the view during a sampling window (its writers lock it for every statement): the previous version is gone.
WITH samples AS MATERIALIZED (
    SELECT g, u.pids
    FROM generate_series(1, {samples}) g
    CROSS JOIN LATERAL (SELECT pg_sleep({interval_s}) WHERE g > 0) pause
    CROSS JOIN LATERAL (
        SELECT string_agg(DISTINCT l.pid::text, ',') AS pids
        FROM pg_locks l
        WHERE l.locktype = 'relation' AND l.relation = to_regclass({view_reg})
          AND l.pid <> pg_backend_pid() AND g > 0
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    ) u
)
SELECT format('%s is still used by other sessions (pids %s) during the %s s window; phase %s needs every instance of the previous version (which writes to %s) gone — finish the rollout, then run this phase again',
              {view_reg}, string_agg(DISTINCT samples.pids, ','), {window_s}, {phase}, {view_reg})
FROM samples
WHERE samples.pids IS NOT NULL
HAVING count(*) > 0
