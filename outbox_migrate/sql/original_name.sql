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

-- name: view-writes-counted
-- The view's use counter is in place: its sequence exists and every counting rule is on the view.
SELECT format('%s does not count its writes (missing: %s); the count-view-writes step did not run, or its objects were dropped by hand',
              {view_reg}, concat_ws(', ',
                  CASE WHEN to_regclass({seq_reg}) IS NULL THEN 'sequence ' || {seq_reg} END,
                  (SELECT 'rules ' || string_agg(r, ', ') FROM unnest({rules}) r
                   WHERE NOT EXISTS (SELECT 1 FROM pg_rewrite w
                                     WHERE w.ev_class = to_regclass({view_reg}) AND w.rulename = r))))
WHERE to_regclass({seq_reg}) IS NULL
   OR (SELECT count(*) FROM pg_rewrite w
       WHERE w.ev_class = to_regclass({view_reg}) AND w.rulename = ANY ({rules})) < cardinality({rules})

-- name: no-view-users
-- No write went through the view during a sampling window (its use counter stood still) and no other session holds it at any sample (a transaction that used it is still open).
-- The counter is read before and after the window; where it stood is kept in a session
-- setting for `no-view-writes-since-sample`, checked under the step's lock.
WITH before AS MATERIALIZED (
    SELECT to_regclass({seq_reg}) AS oid,
           coalesce(has_sequence_privilege(to_regclass({seq_reg}), 'SELECT'), false) AS readable,
           coalesce(CASE WHEN has_sequence_privilege(to_regclass({seq_reg}), 'SELECT')
                         THEN pg_sequence_last_value(to_regclass({seq_reg})) END, 0) AS value
), samples AS MATERIALIZED (
    SELECT g, u.pids
    FROM before
    CROSS JOIN generate_series(1, {samples}) g
    -- both laterals name g (and the pause names before): evaluated per sample, after before
    CROSS JOIN LATERAL (SELECT pg_sleep({interval_s}) WHERE g > 0 AND before.value >= 0) pause
    CROSS JOIN LATERAL (
        SELECT string_agg(DISTINCT l.pid::text, ',') AS pids
        FROM pg_locks l
        WHERE l.locktype = 'relation' AND l.relation = to_regclass({view_reg})
          AND l.pid <> pg_backend_pid() AND g > 0
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    ) u
), seen AS MATERIALIZED (
    SELECT string_agg(DISTINCT samples.pids, ',') AS pids FROM samples
), after AS MATERIALIZED (
    SELECT v.value, seen.pids, set_config({sample_key}, v.value::text, false) AS saved
    FROM before, seen,
         -- names seen: read after the window, not before it
         LATERAL (SELECT coalesce(CASE WHEN before.readable
                                       THEN pg_sequence_last_value(before.oid) END, 0) AS value,
                         seen.pids AS after_window) v
)
SELECT CASE
    WHEN before.oid IS NULL
    THEN format('%s has no use counter (%s is missing); the count-view-writes step of phase %s must run first', {view_reg}, {seq_reg}, {phase})
    WHEN NOT before.readable
    THEN format('%s: role %s cannot read the use counter %s (a gate does not pass on what it cannot see); run as the role that ran count-view-writes, or GRANT SELECT ON SEQUENCE %s TO %s', {view_reg}, current_user, {seq_reg}, {seq_reg}, current_user)
    WHEN after.value > before.value
    THEN format('%s is still written through: %s statements in %s s; phase %s needs every instance of the previous version (which writes to %s) gone — finish the rollout, then run this phase again',
                {view_reg}, after.value - before.value, {window_s}, {phase}, {view_reg})
    ELSE format('%s is still used by other sessions (pids %s) during the %s s window; phase %s needs every instance of the previous version (which writes to %s) gone — finish the rollout, then run this phase again',
                {view_reg}, after.pids, {window_s}, {phase}, {view_reg}) END
FROM before, after
WHERE before.oid IS NULL OR NOT before.readable OR after.value > before.value
   OR after.pids IS NOT NULL

-- name: no-view-writes-since-sample
-- Under the step's lock: no write went through the view since the gate's window (its use counter has not moved).
WITH saved AS MATERIALIZED (
    SELECT nullif(coalesce(current_setting({sample_key}, true), ''), '')::bigint AS value
), now_ AS MATERIALIZED (
    SELECT coalesce(CASE WHEN has_sequence_privilege(to_regclass({seq_reg}), 'SELECT')
                         THEN pg_sequence_last_value(to_regclass({seq_reg})) END, 0) AS value,
           coalesce(has_sequence_privilege(to_regclass({seq_reg}), 'SELECT'), false) AS readable
)
SELECT CASE WHEN NOT now_.readable
            THEN format('%s: role %s cannot read the use counter %s; run as the role that ran count-view-writes, or GRANT SELECT ON SEQUENCE %s TO %s', {view_reg}, current_user, {seq_reg}, {seq_reg}, current_user)
            WHEN saved.value IS NULL
            THEN format('%s: the gate did not sample the view in this session; phase %s needs its sampling window first', {view_reg}, {phase})
            ELSE format('%s was written through after the gate sampled (use counter at %s, was %s); phase %s needs every instance of the previous version (which writes to %s) gone',
                        {view_reg}, now_.value, saved.value, {phase}, {view_reg}) END
FROM saved, now_
WHERE NOT now_.readable OR saved.value IS NULL OR now_.value > saved.value
