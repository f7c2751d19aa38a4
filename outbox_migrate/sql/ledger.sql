-- The runner's ledger: one migration per (table, pattern), one row per step.
-- Invariants live in the database: one active migration per table (partial unique index),
-- known states only (CHECKs), steps belong to a migration (FK).

-- name: upgrade-1
-- Version 1 of the ledger schema.
CREATE TABLE outbox_migrate.migration (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    table_schema text NOT NULL,
    table_name text NOT NULL,
    pattern text NOT NULL,
    spec jsonb NOT NULL,
    state text NOT NULL DEFAULT 'active'
        CHECK (state IN ('active', 'completed', 'abandoned')),
    current_phase text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    operator text NOT NULL DEFAULT current_user,
    host text
);
CREATE UNIQUE INDEX migration_one_per_table_and_pattern
    ON outbox_migrate.migration (table_schema, table_name, pattern) WHERE state <> 'abandoned';
CREATE UNIQUE INDEX migration_one_active_per_table
    ON outbox_migrate.migration (table_schema, table_name) WHERE state = 'active';
CREATE TABLE outbox_migrate.step (
    migration_id bigint NOT NULL REFERENCES outbox_migrate.migration (id),
    position int NOT NULL,
    step_id text NOT NULL,
    phase text NOT NULL,
    kind text NOT NULL,
    checksum text NOT NULL,
    state text NOT NULL DEFAULT 'pending'
        CHECK (state IN ('pending', 'running', 'done', 'failed', 'rolled_back')),
    attempts int NOT NULL DEFAULT 0,
    started_at timestamptz,
    finished_at timestamptz,
    duration_ms double precision,
    lock_wait_ms double precision NOT NULL DEFAULT 0,
    last_error text,
    operator text,
    host text,
    PRIMARY KEY (migration_id, step_id)
);
CREATE TABLE outbox_migrate.attempt (
    migration_id bigint NOT NULL,
    step_id text NOT NULL,
    attempt int NOT NULL,
    at timestamptz NOT NULL DEFAULT now(),
    outcome text NOT NULL,
    waited_ms double precision NOT NULL,
    blockers jsonb NOT NULL DEFAULT '[]',
    FOREIGN KEY (migration_id, step_id) REFERENCES outbox_migrate.step (migration_id, step_id)
)

-- name: upgrade-2
-- Version 2: every object a migration created or took over, by OID. Rollback drops only
-- objects recorded here as this migration's own; re-runs adopt only objects no live
-- migration owns. Names are kept for messages; the OID is what is compared.
CREATE TABLE outbox_migrate.owned_object (
    migration_id bigint NOT NULL REFERENCES outbox_migrate.migration (id),
    step_id text NOT NULL,
    kind text NOT NULL CHECK (kind IN ('relation', 'constraint', 'trigger', 'function')),
    object_oid oid NOT NULL,
    name text NOT NULL,
    origin text NOT NULL CHECK (origin IN ('created', 'adopted', 'found')),
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (migration_id, kind, object_oid)
);
CREATE INDEX owned_object_by_oid ON outbox_migrate.owned_object (kind, object_oid)

-- name: upgrade-3
-- Version 3: publication memberships a migration added (CDC users: the unpublished partition in their publication) are owned objects too, by their pg_publication_rel OID.
ALTER TABLE outbox_migrate.owned_object DROP CONSTRAINT owned_object_kind_check;
ALTER TABLE outbox_migrate.owned_object ADD CONSTRAINT owned_object_kind_check
    CHECK (kind IN ('relation', 'constraint', 'trigger', 'function', 'publication-rel'))
