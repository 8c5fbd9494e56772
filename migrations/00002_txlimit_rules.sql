-- +goose Up

-- The rules, each written once. Times are microseconds since the Unix epoch. A limit refills in
-- whole steps of step_us microseconds: 1 for a token bucket, Period for a fixed window, whose
-- windows start on the grid anchor_us + k·Period (anchor_us is 0 for a token bucket). The Go
-- reference model (ratelimit/model_test.go) performs the same float8 operations in the same order,
-- so both give bit-identical results. The SQL functions here are inlined into the statements that
-- call them; keep each one a single expression.

-- txlimit_clock: the instant a decision is taken at, read once per statement: now_us when the
-- caller supplies it (LimiterConfig.Now), else the database's clock.
-- +goose StatementBegin
CREATE FUNCTION txlimit_clock(now_us bigint)
RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
    SELECT coalesce(now_us, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
$$;
-- +goose StatementEnd

-- txlimit_level: the tokens a row (value, ts_us) holds at now_us: the refill of the whole steps
-- since ts_us, Rate per Period, capped. Time never runs backwards: a now_us before ts_us refills
-- nothing.
-- +goose StatementBegin
CREATE FUNCTION txlimit_level(value double precision, ts_us bigint, now_us bigint, rate double precision,
                              period_us bigint, step_us bigint, cap double precision)
RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT least(value + ((greatest(now_us - ts_us, 0) / step_us)::double precision * rate)
                         / (period_us / step_us)::double precision,
                 cap)
$$;
-- +goose StatementEnd

-- txlimit_next_ts: the ts a row moves to when evaluated at now_us: the start of the step holding
-- now_us (now itself for a token bucket, the window's start for a fixed window), never before
-- ts_us.
-- +goose StatementBegin
CREATE FUNCTION txlimit_next_ts(ts_us bigint, now_us bigint, step_us bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ts_us + (greatest(now_us - ts_us, 0) / step_us) * step_us
$$;
-- +goose StatementEnd

-- txlimit_charge: which candidate rows a request charges, 1 (row a), 2 (row b) or 3 (both), given
-- the tokens lv_a and (when two) lv_b they hold: the fuller alone when it holds count (a on a tie),
-- else both so that they end equal, unless they differ by more than count (then the fuller alone:
-- charging both equal would hand the emptier one tokens). fixed_charge 1 or 2 keeps that row (the
-- only one locked); 0 and 3 choose freely.
-- +goose StatementBegin
CREATE FUNCTION txlimit_charge(lv_a double precision, lv_b double precision, two boolean,
                               count double precision, fixed_charge integer)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN NOT two THEN 1
                WHEN fixed_charge IN (1, 2) THEN fixed_charge
                WHEN greatest(lv_a, lv_b) >= count THEN CASE WHEN lv_a >= lv_b THEN 1 ELSE 2 END
                WHEN abs(lv_a - lv_b) <= count THEN 3
                WHEN lv_a >= lv_b THEN 1
                ELSE 2
           END
$$;
-- +goose StatementEnd

-- txlimit_left: what row slot (0: a, 1: b) holds after count is charged as txlimit_charge chose:
-- (lv_a + lv_b - count) / 2 for both, the row's level less count for the row charged, the level
-- of a row not charged. (Written so that each level and count appears once: Postgres then
-- inlines the function around any argument.)
-- +goose StatementBegin
CREATE FUNCTION txlimit_left(slot integer, charge integer, lv_a double precision, lv_b double precision,
                             count double precision)
RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT (CASE WHEN slot = 0 OR charge = 3 THEN lv_a ELSE 0 END
            + CASE WHEN slot = 1 OR charge = 3 THEN lv_b ELSE 0 END
            - CASE WHEN charge = 3 OR charge = slot + 1 THEN count ELSE 0 END)
           / CASE WHEN charge = 3 THEN 2 ELSE 1 END::double precision
$$;
-- +goose StatementEnd

-- txlimit_granted: the grant rule. The emptiest charged row is left with at least -allow: allow is
-- how far below zero the request may take a row (0 without Reserve, MaxReserved per shard with it,
-- +Infinity for no bound). Granted now when that row is left >= 0, as a reservation when below.
-- +goose StatementBegin
CREATE FUNCTION txlimit_granted(charge integer, end_a double precision, end_b double precision,
                                allow double precision)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT least(CASE WHEN charge <> 2 THEN end_a END, CASE WHEN charge <> 1 THEN end_b END) >= -allow
$$;
-- +goose StatementEnd

-- txlimit_prunable: whether a row (value, ts_us) evaluates exactly as a missing row at now_us and
-- at every later instant: full, not ahead of now_us, and on its key's grid of steps (a missing row
-- is full at the grid's anchor).
-- +goose StatementBegin
CREATE FUNCTION txlimit_prunable(value double precision, ts_us bigint, now_us bigint, rate double precision,
                                 period_us bigint, step_us bigint, cap double precision, anchor_us bigint)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT txlimit_level(value, ts_us, now_us, rate, period_us, step_us, cap) >= cap
           AND ts_us <= now_us AND (ts_us - anchor_us) % step_us = 0
$$;
-- +goose StatementEnd

-- txlimit_grants_one: whether a request for count (allowance allow) on the one row (va, ta) is
-- granted at t_us: the test txlimit_retry_at makes, for one row.
-- +goose StatementBegin
CREATE FUNCTION txlimit_grants_one(rate double precision, period_us bigint, step_us bigint, cap double precision,
                                   count double precision, allow double precision, va double precision, ta bigint,
                                   t_us bigint)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT txlimit_granted(1, txlimit_left(0, 1, txlimit_level(va, ta, t_us, rate, period_us, step_us, cap), 0, count),
                           0, allow)
$$;
-- +goose StatementEnd

-- txlimit_estimate: the real-arithmetic instant at which a row short of deficit tokens at from_us
-- (its ts ts_us) has them: the refill, Rate per Period in whole steps, from the start of the step
-- holding from_us; at least 1 µs and at most 2^61 µs after from_us. txlimit_retry_at starts its
-- search there. A deficit above 10^36 is taken as 10^36: no accepted rate (at most 10^15 tokens per
-- µs) refills that much within 2^61 µs, so the estimate is the bound either way, and the product
-- stays within float8 (a debt near the largest float8, which OutOfDebtAt accepts, failed with
-- SQLSTATE 22003).
-- +goose StatementBegin
CREATE FUNCTION txlimit_estimate(rate double precision, period_us bigint, step_us bigint, deficit double precision,
                                 ts_us bigint, from_us bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT from_us + least(greatest((txlimit_next_ts(ts_us, from_us, step_us) - from_us)::double precision
                                    + ceil(least(deficit, 1e36) * (period_us / step_us)::double precision / rate) * step_us::double precision,
                                    1), 2305843009213693952::double precision)::bigint
$$;
-- +goose StatementEnd

-- txlimit_retry_at: the first microsecond t >= from_us at which a request for count (allowance
-- allow) on the rows (va, ta) and, when two, (vb, tb) is granted by the rules above; with count 0
-- and allow 0 on one row, when that row is out of debt. One microsecond earlier the same request is
-- refused, so the answer is exact. The search tests the real-arithmetic estimate first (usually the
-- answer: granted there, refused a microsecond before; for one row before anything else), and only
-- when float8 rounding or a cap puts the answer elsewhere gallops from it and bisects, ending within
-- about 130 tests for any input. The wait is bounded: t is at most from_us + 2^61 µs (about 73,000
-- years, maxRetryWaitMicros in ratelimit); a request not granted by then returns that bound. This is
-- the only place a RetryAt is computed.
-- +goose StatementBegin
CREATE FUNCTION txlimit_retry_at(rate double precision, period_us bigint, step_us bigint, cap double precision,
                                 count double precision, allow double precision, two boolean,
                                 va double precision, ta bigint, vb double precision, tb bigint, from_us bigint)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    -- No defaults here: PL/pgSQL evaluates each at every call, and the one-row answer below needs
    -- none of them; they are set where the search starts.
    max_wait bigint; horizon bigint; lo bigint; hi bigint; stride bigint;
    t bigint; -- the instant tested next
    phase integer; -- what t is: 0 from_us, 1 the estimate, 2 a step down from hi (granted), 3 a step
                   -- up from lo (refused), 4 a bisection point
    lv_a double precision; lv_b double precision; ch integer; end_a double precision; end_b double precision;
    granted boolean;
BEGIN
    -- One row: usually the estimate is the answer (granted there, refused a microsecond earlier).
    IF NOT two THEN
        hi := txlimit_estimate(rate, period_us, step_us,
                               -txlimit_left(0, 1, txlimit_level(va, ta, from_us, rate, period_us, step_us, cap), 0, count)
                               - allow, ta, from_us);
        IF txlimit_grants_one(rate, period_us, step_us, cap, count, allow, va, ta, hi)
           AND NOT txlimit_grants_one(rate, period_us, step_us, cap, count, allow, va, ta, hi - 1) THEN
            RETURN hi;
        END IF;
    END IF;
    -- Else one loop with one test, so that PL/pgSQL prepares the rules' expressions once. From the
    -- estimate the search gallops (strides 1, 2, 4, …) down while granted or up while refused, then
    -- bisects the last stride: float8 rounding puts the answer a few microseconds from the
    -- estimate, so a few tests find it.
    max_wait := 2305843009213693952; -- 2^61
    horizon := from_us + max_wait; lo := from_us; t := from_us; phase := 0; lv_b := 0;
    LOOP
        -- The test: whether the request is granted at t.
        lv_a := txlimit_level(va, ta, t, rate, period_us, step_us, cap);
        IF two THEN
            lv_b := txlimit_level(vb, tb, t, rate, period_us, step_us, cap);
        END IF;
        ch := txlimit_charge(lv_a, lv_b, two, count, 0);
        end_a := txlimit_left(0, ch, lv_a, lv_b, count);
        end_b := txlimit_left(1, ch, lv_a, lv_b, count);
        granted := txlimit_granted(ch, end_a, end_b, allow);
        IF phase = 0 THEN
            IF granted THEN
                RETURN from_us;
            END IF;
            -- The estimate: when the emptiest charged row has its deficit.
            t := txlimit_estimate(rate, period_us, step_us,
                                  -least(CASE WHEN ch <> 2 THEN end_a END, CASE WHEN ch <> 1 THEN end_b END) - allow,
                                  CASE WHEN ch = 2 THEN tb ELSE ta END, from_us);
            phase := 1;
            CONTINUE;
        ELSIF phase = 1 THEN -- at the estimate: search down when granted, else up
            stride := 1;
            IF granted THEN
                hi := t; phase := 2;
            ELSIF t >= horizon THEN
                RETURN horizon;
            ELSE
                lo := t; phase := 3;
            END IF;
        ELSIF phase = 2 THEN -- galloping down
            IF granted THEN
                hi := t; stride := least(stride * 2, max_wait);
            ELSE
                lo := t; phase := 4;
            END IF;
        ELSIF phase = 3 THEN -- galloping up
            IF granted THEN
                hi := t; phase := 4;
            ELSIF t >= horizon THEN
                RETURN horizon;
            ELSE
                lo := t; stride := least(stride * 2, max_wait);
            END IF;
        ELSIF granted THEN -- bisecting: lo refused, hi granted
            hi := t;
        ELSE
            lo := t;
        END IF;
        IF phase <> 3 AND hi - lo <= 1 THEN
            RETURN hi;
        END IF;
        IF phase = 2 AND hi - stride <= lo THEN
            phase := 4;
        END IF;
        t := CASE phase WHEN 2 THEN hi - stride WHEN 3 THEN least(lo + stride, horizon) ELSE lo + (hi - lo) / 2 END;
    END LOOP;
END
$$;
-- +goose StatementEnd

-- txlimit_debt_until: when a row left at v (its ts ts_us) at t_us is out of debt: txlimit_retry_at
-- with count 0 and allowance 0 on that row; 0 when v >= 0 (not in debt).
-- +goose StatementBegin
CREATE FUNCTION txlimit_debt_until(v double precision, ts_us bigint, t_us bigint, rate double precision,
                                   period_us bigint, step_us bigint, cap double precision)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN v < 0 THEN txlimit_retry_at(rate, period_us, step_us, cap, 0, 0, false, v, ts_us, NULL, NULL, t_us)
                ELSE 0 END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION IF EXISTS txlimit_debt_until(double precision, bigint, bigint, double precision, bigint, bigint, double precision);
DROP FUNCTION IF EXISTS txlimit_retry_at(double precision, bigint, bigint, double precision, double precision,
                                         double precision, boolean, double precision, bigint, double precision, bigint, bigint);
DROP FUNCTION IF EXISTS txlimit_estimate(double precision, bigint, bigint, double precision, bigint, bigint);
DROP FUNCTION IF EXISTS txlimit_grants_one(double precision, bigint, bigint, double precision, double precision, double precision,
                                           double precision, bigint, bigint);
DROP FUNCTION IF EXISTS txlimit_prunable(double precision, bigint, bigint, double precision, bigint, bigint, double precision, bigint);
DROP FUNCTION IF EXISTS txlimit_granted(integer, double precision, double precision, double precision);
DROP FUNCTION IF EXISTS txlimit_left(integer, integer, double precision, double precision, double precision);
DROP FUNCTION IF EXISTS txlimit_charge(double precision, double precision, boolean, double precision, integer);
DROP FUNCTION IF EXISTS txlimit_next_ts(bigint, bigint, bigint);
DROP FUNCTION IF EXISTS txlimit_level(double precision, bigint, bigint, double precision, bigint, bigint, double precision);
DROP FUNCTION IF EXISTS txlimit_clock(bigint);
