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

-- txlimit_charge chooses which candidate rows a request charges: 1 (row a), 2 (row b) or 3 (both),
-- given the tokens lv_a and (when two) lv_b they hold. With fixed_charge 0 it chooses freely: the
-- row with more tokens if either alone holds count (a on a tie), else both so they end equal, unless
-- they differ by more than count (then the fuller alone: charging both equal would hand the emptier
-- one tokens). With fixed_charge 1 or 2 that row stays charged; with 3 the choice is between both
-- and the fuller alone. Decide calls it on the lock-free read to pick the rows to lock, then with
-- that choice fixed on the locked rows' latest levels. (Migration 00003 replaces it: with 3, the
-- choice is free again.)
-- +goose StatementBegin
CREATE FUNCTION txlimit_charge(lv_a double precision, lv_b double precision, two boolean,
                               count double precision, fixed_charge integer)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN NOT two THEN 1
                WHEN fixed_charge IN (1, 2) THEN fixed_charge
                WHEN fixed_charge = 0 AND greatest(lv_a, lv_b) >= count THEN CASE WHEN lv_a >= lv_b THEN 1 ELSE 2 END
                WHEN abs(lv_a - lv_b) <= count THEN 3
                WHEN lv_a >= lv_b THEN 1
                ELSE 2
           END
$$;
-- +goose StatementEnd

-- txlimit_left is what candidate row slot (0: a, 1: b) holds after a request for count is charged
-- as txlimit_charge chose: lv - count for the row charged alone, (lv_a + lv_b - count)/2 for both,
-- its level unchanged when it is not charged.
-- +goose StatementBegin
CREATE FUNCTION txlimit_left(slot integer, charge integer, lv_a double precision, lv_b double precision,
                             count double precision)
RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN charge = 3 THEN (lv_a + lv_b - count) / 2
                WHEN slot = 0 AND charge = 1 THEN lv_a - count
                WHEN slot = 1 AND charge = 2 THEN lv_b - count
                WHEN slot = 0 THEN lv_a
                ELSE lv_b
           END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION txlimit_left(integer, integer, double precision, double precision, double precision);
DROP FUNCTION txlimit_charge(double precision, double precision, boolean, double precision, integer);
DROP FUNCTION txlimit_next_ts(smallint, bigint, bigint, bigint);
DROP FUNCTION txlimit_level(smallint, double precision, bigint, bigint, double precision, bigint, double precision);
DROP TABLE txlimit_state;
