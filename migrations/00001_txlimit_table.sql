-- +goose Up

-- The state: one row per (name, key, shard), the two numbers of a limit. value is the tokens it
-- held at ts, a time in microseconds since the Unix epoch (negative while reservations are owed).
-- A missing row is a full, untouched limit; configs travel with each call, so nothing else is
-- stored. Names and keys compare as bytes (COLLATE "C"), the order rows are locked in. Every
-- granted decision updates a row: no column that changes is indexed and pages keep free space,
-- so the updates are HOT. The table has no CHECK constraint: Postgres would prepare its expression
-- again for every statement that writes a row (a fifth of a decision's cost); the library
-- validates every shard number before it is sent.
CREATE TABLE txlimit_state (
    name  text COLLATE "C" NOT NULL,
    key   text COLLATE "C" NOT NULL,
    shard integer          NOT NULL DEFAULT 0,
    value double precision NOT NULL,
    ts    bigint           NOT NULL,
    CONSTRAINT txlimit_state_pkey PRIMARY KEY (name, key, shard)
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);

COMMENT ON COLUMN txlimit_state.ts IS 'microseconds since the Unix epoch (to_timestamp(ts / 1e6) shows it as a time)';

-- +goose Down
DROP TABLE txlimit_state;
