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
