-- +goose Up

-- One row per (name, key, shard): the two numbers of a limit. A missing row is a full, untouched
-- limit; configs travel with each call, so nothing else is stored. The table is updated on every
-- granted decision: no column that changes is indexed and pages keep free space, so updates are HOT.
CREATE TABLE txlimit_state (
    name  text             NOT NULL,
    key   text             NOT NULL,
    shard integer          NOT NULL DEFAULT 0,
    value double precision NOT NULL,
    ts    timestamptz      NOT NULL,
    CONSTRAINT txlimit_state_pkey PRIMARY KEY (name, key, shard),
    CONSTRAINT txlimit_state_shard_check CHECK (shard >= 0)
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);

-- txlimit_level is the number of tokens a row holds at now_us (microseconds since the Unix epoch):
-- the refill since ts_us is added and the sum is capped at cap. kind 0 is a token bucket (continuous
-- refill of rate per period_us), kind 1 a fixed window (rate per whole elapsed period). Time never
-- runs backwards: a now_us before ts_us refills nothing. The Go reference model mirrors this
-- expression operation by operation so that both give bit-identical float8 results.
-- +goose StatementBegin
CREATE FUNCTION txlimit_level(kind smallint, value double precision, ts_us bigint, now_us bigint,
                              rate double precision, period_us bigint, cap double precision)
RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT least(
        CASE WHEN kind = 0
            THEN value + greatest(now_us - ts_us, 0)::double precision * rate / period_us::double precision
            ELSE value + rate * (greatest(now_us - ts_us, 0) / period_us)::double precision
        END,
        cap)
$$;
-- +goose StatementEnd

-- txlimit_next_ts is the timestamp (microseconds since the Unix epoch) a row moves to when it is
-- evaluated at now_us: now for a token bucket, the start of the current window for a fixed window.
-- It is never before ts_us.
-- +goose StatementBegin
CREATE FUNCTION txlimit_next_ts(kind smallint, ts_us bigint, now_us bigint, period_us bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN kind = 0
        THEN greatest(ts_us, now_us)
        ELSE ts_us + (greatest(now_us - ts_us, 0) / period_us) * period_us
    END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION txlimit_next_ts(smallint, bigint, bigint, bigint);
DROP FUNCTION txlimit_level(smallint, double precision, bigint, bigint, double precision, bigint, double precision);
DROP TABLE txlimit_state;
