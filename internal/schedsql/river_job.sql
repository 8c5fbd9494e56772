-- The columns of River's river_job and river_queue tables that the scheduler's queries use, declared for sqlc's
-- type checking only: nothing runs this file. River creates the real table (scheduler.Migrate,
-- River's own migrator); see docs/scheduler.md.
CREATE TYPE river_job_state AS ENUM (
    'available', 'cancelled', 'completed', 'discarded', 'pending', 'retryable', 'running', 'scheduled'
);

CREATE TABLE river_job (
    id           bigint PRIMARY KEY,
    state        river_job_state NOT NULL,
    attempt      smallint NOT NULL,
    attempted_at timestamptz,
    scheduled_at timestamptz NOT NULL,
    finalized_at timestamptz,
    queue        text NOT NULL,
    metadata     jsonb NOT NULL
);

CREATE TABLE river_queue (
    name       text PRIMARY KEY,
    updated_at timestamptz NOT NULL
);
