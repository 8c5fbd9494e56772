-- +goose Up

-- One row per (name, key, shard): the two numbers of a limit. A missing row is a full, untouched
-- limit; configs travel with each call, so nothing else is stored. Every granted decision updates
-- a row: no column that changes is indexed and pages keep free space, so updates are HOT.
CREATE TABLE txlimit_state (
    name  text             NOT NULL,
    key   text             NOT NULL,
    shard integer          NOT NULL DEFAULT 0,
    value double precision NOT NULL,
    ts    timestamptz      NOT NULL,
    CONSTRAINT txlimit_state_pkey PRIMARY KEY (name, key, shard),
    CONSTRAINT txlimit_state_shard_check CHECK (shard >= 0)
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);

-- The algebra, each rule once. Times are microseconds since the Unix epoch; kind 0 is a token
-- bucket, 1 a fixed window. The Go reference model (ratelimit/model_test.go) performs the same
-- float8 operations in the same order, so both give bit-identical results.

-- txlimit_level: the tokens a row (value, ts_us) holds at now_us: the refill since ts_us, capped.
-- Time never runs backwards: a now_us before ts_us refills nothing.
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

-- txlimit_next_ts: the ts a row moves to when evaluated at now_us: now for a token bucket, the
-- start of the current window for a fixed window; never before ts_us.
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

-- txlimit_missing_ts: the ts that makes a row of value cap evaluate exactly as a missing row at any
-- later instant (full, and on the key's window grid: a fixed window's grid starts at anchor_us).
-- +goose StatementBegin
CREATE FUNCTION txlimit_missing_ts(kind smallint, anchor_us bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN kind = 0 THEN 0 ELSE anchor_us END
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
-- inlines the function around any argument, such as a txlimit_level expression.)
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

-- txlimit_granted: the grant rule. low is what the emptiest charged row is left with; allow is
-- how far below zero the request may take it (0 without Reserve, MaxReserved per shard with it,
-- +Infinity for no bound). Granted now when low >= 0, as a reservation when -allow <= low < 0.
-- +goose StatementBegin
CREATE FUNCTION txlimit_granted(charge integer, end_a double precision, end_b double precision,
                                allow double precision)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT least(CASE WHEN charge <> 2 THEN end_a END, CASE WHEN charge <> 1 THEN end_b END) >= -allow
$$;
-- +goose StatementEnd

-- txlimit_estimate: the real-arithmetic instant after from_us at which a row short of deficit
-- tokens has them: ceil(deficit/r) µs later for a token bucket, ceil(deficit/Rate) windows after
-- the current window's start (window_start) for a fixed window; at least 1 µs and at most 2^61 µs
-- after from_us. txlimit_first_grant starts its search there.
-- +goose StatementBegin
CREATE FUNCTION txlimit_estimate(kind smallint, rate double precision, period_us bigint, deficit double precision,
                                 window_start bigint, from_us bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT from_us + least(greatest(
        CASE WHEN kind = 0 THEN ceil(deficit * period_us::double precision / rate)
             ELSE (window_start - from_us)::double precision + ceil(deficit / rate) * period_us::double precision
        END, 1), 2305843009213693952::double precision)::bigint
$$;
-- +goose StatementEnd

-- txlimit_grant_starts_at: whether a request for count (allowance allow) on the one row (va, ta)
-- is granted at t_us and refused at t_us - 1: then t_us is the first instant it is granted (a
-- row's level never falls as time passes), so a real-arithmetic estimate that passes this test is
-- exact.
-- +goose StatementBegin
CREATE FUNCTION txlimit_grant_starts_at(kind smallint, rate double precision, period_us bigint, cap double precision,
                                        count double precision, allow double precision,
                                        va double precision, ta bigint, t_us bigint)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT txlimit_granted(1, txlimit_left(0, 1, txlimit_level(kind, va, ta, t_us, rate, period_us, cap), 0, count),
                           0, allow)
           AND NOT txlimit_granted(1, txlimit_left(0, 1, txlimit_level(kind, va, ta, t_us - 1, rate, period_us, cap),
                                                   0, count),
                                   0, allow)
$$;
-- +goose StatementEnd

-- txlimit_first_grant: the first microsecond t >= from_us at which a request for count (allowance
-- allow) on rows (va, ta) and, when two, (vb, tb) is granted by the rules above (with count 0 and
-- allow 0 on a single row: when that row is out of debt). It searches on the very rules a decision
-- applies, so the answer is exact: one microsecond earlier the same request is refused. It tries
-- the real-arithmetic estimate (for one row, txlimit_grant_starts_at), and only when float8
-- rounding or a cap puts the answer elsewhere gallops and bisects, so it ends within about 130
-- evaluations for any input. The wait is bounded: t is at most from_us + 2^61 µs (about 73,000
-- years, ratelimit.MaxRetryWaitMicros); a request not granted by then returns that bound.
-- +goose StatementBegin
CREATE FUNCTION txlimit_first_grant(kind smallint, rate double precision, period_us bigint, cap double precision,
                                    count double precision, allow double precision, two boolean,
                                    va double precision, ta bigint, vb double precision, tb bigint,
                                    from_us bigint)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    max_wait constant bigint := 2305843009213693952; -- 2^61
    horizon bigint := from_us + max_wait;
    lo bigint := from_us; hi bigint; step bigint;
    t bigint := from_us; -- the instant tested next
    phase integer := 0; -- what t is: 0 from_us, 1 the estimate then each gallop step (hi), 2 hi - 1,
                        -- 3 a bisection point
    lv_a double precision; lv_b double precision := 0; ch integer; end_a double precision; end_b double precision;
    granted boolean;
BEGIN
    -- One loop with one test, so that PL/pgSQL prepares the rules' expressions once (it prepares
    -- each expression when it first runs in a transaction, which on a pool is every call).
    LOOP
        -- Whether the request is granted at t.
        lv_a := txlimit_level(kind, va, ta, t, rate, period_us, cap);
        IF two THEN
            lv_b := txlimit_level(kind, vb, tb, t, rate, period_us, cap);
        END IF;
        ch := txlimit_charge(lv_a, lv_b, two, count, 0);
        end_a := txlimit_left(0, ch, lv_a, lv_b, count);
        end_b := txlimit_left(1, ch, lv_a, lv_b, count);
        granted := txlimit_granted(ch, end_a, end_b, allow);
        IF phase = 0 THEN
            IF granted THEN
                RETURN from_us;
            END IF;
            -- The estimate: the deficit of the emptiest charged row at from_us, refilled at rate.
            hi := txlimit_estimate(kind, rate, period_us,
                                   -least(CASE WHEN ch <> 2 THEN end_a END, CASE WHEN ch <> 1 THEN end_b END) - allow,
                                   txlimit_next_ts(kind, CASE WHEN ch = 2 THEN tb ELSE ta END, from_us, period_us), from_us);
            -- One row: usually the estimate is the answer (granted there, refused a microsecond
            -- earlier). (A nested IF, so that two rows never prepare this expression.)
            IF NOT two THEN
                IF txlimit_grant_starts_at(kind, rate, period_us, cap, count, allow, va, ta, hi) THEN
                    RETURN hi;
                END IF;
            END IF;
            step := greatest(hi - lo, 1);
            phase := 1; t := hi;
        ELSIF phase = 1 THEN
            -- Gallop until granted at hi (not granted at lo), then test hi - 1: for two rows the
            -- estimate is usually the answer, refused one microsecond earlier.
            IF NOT granted THEN
                IF hi >= horizon THEN
                    RETURN horizon;
                END IF;
                lo := hi;
                hi := least(hi + step, horizon);
                step := least(step * 2, max_wait);
                t := hi;
            ELSIF hi - lo > 1 THEN
                phase := 2; t := hi - 1;
            ELSE
                RETURN hi;
            END IF;
        ELSE
            -- Bisection between lo (refused) and hi (granted); its first point is hi - 1, where a
            -- refusal ends the search at once (the usual case).
            IF phase = 2 AND NOT granted THEN
                RETURN hi;
            END IF;
            IF granted THEN
                hi := t;
            ELSE
                lo := t;
            END IF;
            IF hi - lo <= 1 THEN
                RETURN hi;
            END IF;
            phase := 3; t := lo + (hi - lo) / 2;
        END IF;
    END LOOP;
END
$$;
-- +goose StatementEnd

-- txlimit_xid8: the 64-bit transaction ID nearest xr whose low 32 bits are xid.
-- +goose StatementBegin
CREATE FUNCTION txlimit_xid8(xid bigint, xr bigint)
RETURNS bigint LANGUAGE sql IMMUTABLE AS $$
    SELECT xr + ((xid - (xr & 4294967295)) % 4294967296 + 4294967296 + 2147483648) % 4294967296 - 2147483648
$$;
-- +goose StatementEnd

-- txlimit_stale: whether a row whose xmax is xm (a 32-bit transaction ID; 0 or NULL: none) was
-- written or locked by a transaction that the snapshot snap cannot see, in progress or committed
-- after snap was taken (xr: snap's xmax as a number). Under REPEATABLE READ or SERIALIZABLE,
-- steering passes over such a row (see txlimit_decide).
-- +goose StatementBegin
CREATE FUNCTION txlimit_stale(xm bigint, xr bigint, snap pg_snapshot)
RETURNS boolean LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(xm, 0) <> 0 AND txlimit_xid8(xm, xr) >= 3
           AND NOT pg_visible_in_snapshot(txlimit_xid8(xm, xr)::text::xid8, snap)
           AND (txlimit_xid8(xm, xr) >= xr OR pg_xact_status(txlimit_xid8(xm, xr)::text::xid8) IS DISTINCT FROM 'aborted')
$$;
-- +goose StatementEnd

-- txlimit_steer: the steering of a sharded request (see txlimit_decide, "Sharded requests"): the
-- position (from 1) in shards of the first candidate whose transaction-scoped advisory lock
-- (lock_key XOR the shard) this transaction gets without waiting and, under a snapshot (snap not
-- NULL, xr its xmax), whose row (s_name, s_key, shard) is not stale; NULL when every candidate is
-- taken. Under a snapshot it also returns the chosen row as read (found, value, ts_us); under READ
-- COMMITTED it reads nothing. Called by txlimit_decide only, whose settings keep its read on the
-- primary key.
-- +goose StatementBegin
CREATE FUNCTION txlimit_steer(lock_key bigint, shards integer[], s_name text, s_key text, snap pg_snapshot, xr bigint,
                              OUT pos integer, OUT found boolean, OUT value double precision, OUT ts_us bigint)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    xm bigint;
BEGIN
    FOR j IN 1 .. cardinality(shards) LOOP
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(lock_key # shards[j]::bigint);
        IF snap IS NOT NULL THEN
            SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint, s.xmax::text::bigint INTO value, ts_us, xm
            FROM txlimit_state s
            WHERE s.name = s_name AND s.key = s_key AND s.shard = shards[j];
            found := FOUND;
            CONTINUE WHEN txlimit_stale(xm, xr, snap);
        END IF;
        pos := j;
        RETURN;
    END LOOP;
    found := NULL; value := NULL; ts_us := NULL;
END
$$;
-- +goose StatementEnd

-- txlimit_decide decides a list of requests in one statement; every call of the library is one
-- call of it (a single Limit is a list of one). Arrays are parallel: one element per request, per
-- candidate shard, or per row. The caller (ratelimit/engine.go) numbers the rows the list may
-- touch in the global lock order (name, key, shard, compared as bytes) and tells each request
-- which rows its candidate shards are.
--
-- Requests: p_grp (the request's all-or-nothing group: groups are numbered 0, 1, 2, ... in list
-- order, without gaps, and a group's requests are consecutive; the lean road below relies on this
-- and does not check it), p_count, p_allow (how far below zero a reservation may go per shard: 0
-- without Reserve, +Infinity for no bound), p_dry (Check: decide, lock and write nothing), p_steer
-- (a lone sharded request: choose its shards away from concurrent callers), the config per shard
-- (p_kind, p_rate, p_period_us, p_cap, p_anchor_us), p_lock_base (the advisory-lock hash of (name,
-- key)), and its candidates p_cand_shard/p_cand_row from p_cand_off, p_cand_n of them (the two
-- random picks first).
-- Rows: p_row_name, p_row_key, p_row_shard, and p_row_bulk (read in the first pass).
--
-- Steps:
-- 1. Plan, on lock-free reads, request after request in list order, each seeing the planned effect
--    of the groups before it: which rows each group that would be granted charges.
-- 2. Lock those rows in row order (the global order), FOR UPDATE, which re-reads their latest
--    committed version. A missing row is inserted full, stamped so that it evaluates exactly as
--    missing, and so created and locked here: no caller ever re-runs a decision.
-- 3. When a locked row differs from the row read (a concurrent transaction changed it under READ
--    COMMITTED), decide again, in list order, on the locked versions; a request is then granted
--    only on rows this transaction holds (else it is refused: an under-grant, never an
--    over-grant). When none differs, the first pass's answers stand.
-- 4. Write every row a granted group changed; a denied group writes nothing.
-- Every access is a primary-key probe (sequential and bitmap scans, hash and merge joins are off
-- for this function), so under SERIALIZABLE a decision holds predicate locks on the rows it reads
-- only.
--
-- Four shapes take shorter roads through the same steps and rules (PL/pgSQL's cost is the
-- statements it runs and the expressions it evaluates, each prepared once per transaction, so
-- each one saved is time saved):
-- - A lone request on one row (an unsharded Limit, Check): steps 2 and 4 are one statement, an
--   UPDATE of the row where it is still as read (or an INSERT of a row that was missing); only
--   when the row changed meanwhile, or is held by another transaction, is it locked and decided
--   again.
-- - A lone steered request (a sharded Limit) charging one shard: after steering, one statement
--   locks that row without waiting and writes it where it is still as read (or inserts it when it
--   was missing). Any other outcome (both shards charged, the row changed or held meanwhile) goes
--   on through the general path with the shards steering chose.
-- - A list whose groups are each one request on one row (a Batcher's batch of Limit and Check
--   calls): step 1 is a loop over the requests that keeps no per-request plan (each row depends on
--   its own requests only), a run of identical refusals searches its RetryAt once, and step 2 is
--   one statement when every row to lock exists.
-- - Such a list whose rows each have one request (calls on keys of their own), no Check among
--   them, when the first row (in row order) would grant its request now: steps 1, 2 and 4 are
--   first one UPDATE, in row order, of every row whose latest version grants its request now (not
--   as a reservation); Postgres evaluates the rules on that version, re-read when another
--   transaction changed it meanwhile. When that is every request, the list is decided; otherwise
--   the UPDATE is undone with its locks (a subtransaction) and the road above decides the list.
--   (The probe of the first row keeps a list of refusals from paying for an UPDATE.) Only the first
--   write of a transaction takes this road, so a transaction uses one subtransaction ID at most.
--
-- Sharded requests: see the package doc of ratelimit ("Shards"). A steered request takes as shard
-- a the first candidate whose transaction-scoped advisory lock (p_lock_base XOR this table's OID
-- shifted left 20 bits XOR the shard) it gets without waiting, and under REPEATABLE READ or
-- SERIALIZABLE that is not stale (its latest version was written or locked by a transaction this
-- snapshot cannot see: xmax widened to an xid8 next to the snapshot's xmax); b is the candidate
-- after a. When every candidate is taken, READ COMMITTED goes on with the first and a snapshot
-- isolation level returns busy for the request, having read and written nothing. Under a snapshot,
-- b is read only when a alone cannot serve (a row read but not charged makes this transaction a
-- reader of whoever charges it). A lone request charging one shard that another transaction holds
-- takes its other pick instead when that one can serve alone (SKIP LOCKED), and waits only when
-- both are held.
--
-- Output, one row per request in list order: ok (granted now), reserved (granted below zero),
-- busy, level_sum (tokens in the shards looked at: after the charge when granted, before it when
-- not), shard_a, shard_b (-1 when unsharded), charged (1: a, 2: b, 3: both), retry_at_us (0 when
-- granted now: see txlimit_first_grant; for a reservation when its debt is paid, for a refusal when
-- the same request is granted), now_us (the clock reading the list was decided at).
-- +goose StatementBegin
CREATE FUNCTION txlimit_decide(
    p_now timestamptz,
    p_grp integer[], p_count double precision[], p_allow double precision[], p_dry boolean[],
    p_steer boolean[], p_kind smallint[], p_rate double precision[], p_period_us bigint[],
    p_cap double precision[], p_anchor_us bigint[], p_lock_base bigint[],
    p_cand_off integer[], p_cand_n integer[], p_cand_shard integer[], p_cand_row integer[],
    p_row_name text[], p_row_key text[], p_row_shard integer[], p_row_bulk boolean[])
RETURNS TABLE (ok boolean, reserved boolean, busy boolean, level_sum double precision,
               shard_a integer, shard_b integer, charged integer, retry_at_us bigint, now_us bigint)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    n integer := cardinality(p_grp);
    m integer := cardinality(p_row_name);
    t_now bigint := (extract(epoch FROM coalesce(p_now, clock_timestamp())) * 1000000)::bigint;
    snap_iso boolean := current_setting('transaction_isolation') IN ('serializable', 'repeatable read');
    -- Rows: as read without a lock, as locked, and as the current pass has left them.
    r_read boolean[];
    r_ex boolean[];
    r_val double precision[];
    r_ts bigint[];
    l_got boolean[];
    l_val double precision[];
    l_ts bigint[];
    w_mod boolean[]; w_val double precision[];
    w_ts bigint[];
    want boolean[];
    ph_val double precision[];
    ph_ts bigint[];
    -- Requests: the rows chosen, and the answers.
    q_a integer[]; q_b integer[];
    q_two boolean[]; q_charge integer[];
    -- The levels each request was decided on, and the ts of its rows (for its writes).
    q_lva double precision[];
    q_lvb double precision[];
    q_ta bigint[]; q_tb bigint[];
    q_held boolean[]; q_planned boolean[]; q_lvl double precision[];
    o_ok boolean[]; o_res boolean[];
    o_busy boolean[]; o_lvl double precision[];
    o_sa integer[]; o_sb integer[];
    o_ch integer[]; o_retry bigint[];
    g_ok boolean; g_end integer; g integer; pass integer;
    i integer; j integer; r integer; e integer; a integer; b integer; off integer; cnt integer; k bigint;
    kind smallint; fixed integer; ch integer; two boolean; dry boolean;
    va double precision; ta bigint; vb double precision; tb bigint; mts bigint;
    lv_a double precision; lv_b double precision; end_a double precision; end_b double precision;
    granted boolean; now_ok boolean;
    -- Steering.
    base bigint; snap pg_snapshot; xr bigint; x bigint; xm bigint; pos integer;
    -- The lone request's SKIP LOCKED switch.
    pick integer; other integer; tries integer;
    -- Whether a row locked differs from the row read (or a lone request switched shards): only
    -- then is the list decided again on the locked rows; otherwise the first pass stands.
    changed boolean := false;
    -- Every group one request on one candidate row (a batch of Limit and Check calls): the lean
    -- decision loop, on rows that depend on nothing but their own requests.
    lean boolean;
    n_want integer := 0; n_new integer := 0; -- the lean loop's rows to lock, and those to create
    done_rows integer[]; done boolean[]; -- rows the lean list wrote in its first pass
    f_i integer[]; f_lvl double precision[]; -- the one-UPDATE road's requests and their levels
    r_found boolean; b_found boolean; w_found boolean; vb_w double precision; tb_w bigint;
    s_pos integer; -- a lone steered request's chosen candidate (the lone steered road's steering)
    rec record;
    -- The last refusal's search: its inputs and its answer.
    m_key record; m_retry bigint;
    -- The lean loop's search inputs (row, count, allowance) and its last search.
    sv double precision; st bigint; sc double precision; sa double precision;
    m_r integer := 0; m_sv double precision; m_st bigint; m_sc double precision; m_sa double precision;
    m_kind smallint; m_rate double precision; m_per bigint; m_cap double precision;
BEGIN
    -- A lone request on one row (an unsharded limit, the most common call) takes a short path:
    -- the same steps and the same rules, with none of the arrays a list needs.
    IF n = 1 AND m = 1 AND p_cand_n[1] = 1 THEN
        kind := p_kind[1];
        mts := txlimit_missing_ts(kind, p_anchor_us[1]);
        -- (xmax equal to xmin: a lock its committed writer kept on the version it wrote, gone now.)
        SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint,
               CASE WHEN s.xmax = s.xmin THEN 0 ELSE s.xmax::text::bigint END
        INTO va, ta, xm
        FROM txlimit_state s
        WHERE s.name = p_row_name[1] AND s.key = p_row_key[1] AND s.shard = p_row_shard[1];
        r_found := FOUND;
        IF NOT r_found THEN
            va := p_cap[1]; ta := mts;
        END IF;
        lv_a := txlimit_level(kind, va, ta, t_now, p_rate[1], p_period_us[1], p_cap[1]);
        end_a := txlimit_left(0, 1, lv_a, 0, p_count[1]);
        granted := txlimit_granted(1, end_a, 0, p_allow[1]);
        IF granted AND NOT p_dry[1] THEN
            -- Write the row if it is still as read (locking it, or creating it when it was missing)
            -- in one statement.
            tb := txlimit_next_ts(kind, ta, t_now, p_period_us[1]);
            -- A row whose xmax is set is probably held by another transaction: a call that may
            -- queue for it (see below) does not wait for it here.
            k := 0;
            IF r_found AND (xm = 0 OR snap_iso OR pg_current_xact_id_if_assigned() IS NOT NULL) THEN
                UPDATE txlimit_state s
                SET value = end_a, ts = 'epoch'::timestamptz + tb * interval '1 microsecond'
                WHERE s.name = p_row_name[1] AND s.key = p_row_key[1] AND s.shard = p_row_shard[1]
                  AND s.value = va AND s.ts = 'epoch'::timestamptz + ta * interval '1 microsecond';
                GET DIAGNOSTICS k = ROW_COUNT;
            ELSIF NOT r_found THEN
                INSERT INTO txlimit_state (name, key, shard, value, ts)
                VALUES (p_row_name[1], p_row_key[1], p_row_shard[1], end_a, 'epoch'::timestamptz + tb * interval '1 microsecond')
                ON CONFLICT DO NOTHING;
                GET DIAGNOSTICS k = ROW_COUNT;
            END IF;
            IF k = 0 THEN
                -- It changed meanwhile, or is held: lock it (creating it when missing) and decide
                -- again on it. Under READ COMMITTED, in a transaction without a transaction ID (it
                -- holds no row lock), a row another transaction holds is first queued for on the
                -- row's queue lock (docs/spec.md §7), so that of the calls waiting for one row only
                -- the first waits on the row itself. Whoever holds a queue lock holds the row or
                -- is waiting for it, so waiting there closes no cycle that waiting on the row would
                -- not. The queue lock is the advisory lock of the row's steering key with bit 19
                -- set (shards stay below 2^11), so it is never one that steering takes.
                IF NOT snap_iso AND pg_current_xact_id_if_assigned() IS NULL THEN
                    SELECT s.value INTO va
                    FROM txlimit_state s
                    WHERE s.name = p_row_name[1] AND s.key = p_row_key[1] AND s.shard = p_row_shard[1]
                    FOR NO KEY UPDATE SKIP LOCKED;
                    IF NOT FOUND THEN
                        PERFORM pg_advisory_xact_lock(p_lock_base[1] # ('txlimit_state'::regclass::oid::bigint << 20)
                                                      # p_row_shard[1]::bigint # 524288);
                    END IF;
                END IF;
                tries := 0;
                LOOP
                    SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO va, ta
                    FROM txlimit_state s
                    WHERE s.name = p_row_name[1] AND s.key = p_row_key[1] AND s.shard = p_row_shard[1]
                    FOR NO KEY UPDATE;
                    EXIT WHEN FOUND;
                    INSERT INTO txlimit_state (name, key, shard, value, ts)
                    VALUES (p_row_name[1], p_row_key[1], p_row_shard[1], p_cap[1],
                            'epoch'::timestamptz + mts * interval '1 microsecond')
                    ON CONFLICT DO NOTHING;
                    GET DIAGNOSTICS k = ROW_COUNT;
                    IF k = 1 THEN
                        va := p_cap[1]; ta := mts;
                        EXIT;
                    END IF;
                    tries := tries + 1;
                    IF tries > 100 THEN
                        RAISE EXCEPTION 'txlimit: row (%, %, %) keeps appearing and vanishing', p_row_name[1], p_row_key[1], p_row_shard[1]
                            USING ERRCODE = '40001';
                    END IF;
                END LOOP;
                lv_a := txlimit_level(kind, va, ta, t_now, p_rate[1], p_period_us[1], p_cap[1]);
                end_a := txlimit_left(0, 1, lv_a, 0, p_count[1]);
                granted := txlimit_granted(1, end_a, 0, p_allow[1]);
                IF granted THEN
                    UPDATE txlimit_state s
                    SET value = end_a, ts = 'epoch'::timestamptz + txlimit_next_ts(kind, ta, t_now, p_period_us[1]) * interval '1 microsecond'
                    WHERE s.name = p_row_name[1] AND s.key = p_row_key[1] AND s.shard = p_row_shard[1];
                END IF;
            END IF;
        END IF;
        now_ok := txlimit_granted(1, end_a, 0, 0);
        -- RetryAt: for a refusal when the same request is granted, for a reservation when its debt
        -- is paid (the row as charged, asked for nothing). Usually the estimate is exact; else the
        -- search finds it.
        m_retry := 0;
        IF NOT now_ok THEN
            IF granted THEN
                sv := end_a; st := txlimit_next_ts(kind, ta, t_now, p_period_us[1]); sc := 0; sa := 0;
            ELSE
                sv := va; st := ta; sc := p_count[1]; sa := p_allow[1];
            END IF;
            m_retry := txlimit_estimate(kind, p_rate[1], p_period_us[1], -end_a - sa,
                                        txlimit_next_ts(kind, ta, t_now, p_period_us[1]), t_now);
            IF NOT txlimit_grant_starts_at(kind, p_rate[1], p_period_us[1], p_cap[1], sc, sa, sv, st, m_retry) THEN
                m_retry := txlimit_first_grant(kind, p_rate[1], p_period_us[1], p_cap[1], sc, sa, false, sv, st, NULL, NULL, t_now);
            END IF;
        END IF;
        ok := now_ok; reserved := granted AND NOT now_ok; busy := false;
        level_sum := CASE WHEN granted THEN end_a ELSE lv_a END;
        shard_a := p_cand_shard[1]; shard_b := -1; charged := 1; retry_at_us := m_retry; now_us := t_now;
        RETURN NEXT;
        RETURN;
    END IF;

    -- A lone steered request (a sharded Limit alone) steers, then decides as a lone request does,
    -- and when it charges one row, locks it without waiting and writes it where it is still as
    -- read (or creates it, already charged, when it was missing) in one statement. Otherwise (both
    -- rows charged, or the row changed or held meanwhile) it goes on through the general path on
    -- the shards chosen here.
    IF n = 1 AND p_steer[1] AND NOT p_dry[1] THEN
        kind := p_kind[1]; off := p_cand_off[1]; cnt := p_cand_n[1];
        mts := txlimit_missing_ts(kind, p_anchor_us[1]);
        base := 'txlimit_state'::regclass::oid::bigint << 20;
        IF snap_iso THEN
            snap := pg_current_snapshot();
            xr := pg_snapshot_xmax(snap)::text::bigint;
        END IF;
        r := p_cand_row[off];
        SELECT t.pos, t.found, t.value, t.ts_us INTO s_pos, r_found, va, ta
        FROM txlimit_steer(p_lock_base[1] # base, p_cand_shard[off:off + cnt - 1], p_row_name[r], p_row_key[r], snap, xr) t;
        IF s_pos IS NULL AND snap_iso THEN
            ok := false; reserved := false; busy := true; level_sum := 0;
            shard_a := p_cand_shard[off]; shard_b := p_cand_shard[off + 1]; charged := 0; retry_at_us := 0; now_us := t_now;
            RETURN NEXT;
            RETURN;
        END IF;
        s_pos := coalesce(s_pos, 1);
        a := p_cand_row[off + s_pos - 1];
        b := p_cand_row[off + s_pos % cnt];
        IF NOT snap_iso THEN -- (under a snapshot, row a was read while steering)
            SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO va, ta
            FROM txlimit_state s
            WHERE s.name = p_row_name[a] AND s.key = p_row_key[a] AND s.shard = p_row_shard[a];
            r_found := FOUND;
        END IF;
        IF NOT r_found THEN
            va := p_cap[1]; ta := mts;
        END IF;
        lv_a := txlimit_level(kind, va, ta, t_now, p_rate[1], p_period_us[1], p_cap[1]);
        -- Under a snapshot, b is read only when a cannot serve alone.
        two := cnt >= 2 AND NOT (snap_iso AND lv_a >= p_count[1]);
        lv_b := 0; vb := NULL; tb := NULL;
        IF two THEN
            SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO vb, tb
            FROM txlimit_state s
            WHERE s.name = p_row_name[b] AND s.key = p_row_key[b] AND s.shard = p_row_shard[b];
            b_found := FOUND;
            IF NOT b_found THEN
                vb := p_cap[1]; tb := mts;
            END IF;
            lv_b := txlimit_level(kind, vb, tb, t_now, p_rate[1], p_period_us[1], p_cap[1]);
        END IF;
        ch := txlimit_charge(lv_a, lv_b, two, p_count[1], 0);
        end_a := txlimit_left(0, ch, lv_a, lv_b, p_count[1]);
        end_b := txlimit_left(1, ch, lv_a, lv_b, p_count[1]);
        granted := txlimit_granted(ch, end_a, end_b, p_allow[1]);
        now_ok := txlimit_granted(ch, end_a, end_b, 0);
        k := 0;
        IF granted AND ch IN (1, 2) THEN
            IF ch = 1 THEN
                r := a; sv := end_a; st := txlimit_next_ts(kind, ta, t_now, p_period_us[1]);
                w_found := r_found; vb_w := va; tb_w := ta;
            ELSE
                r := b; sv := end_b; st := txlimit_next_ts(kind, tb, t_now, p_period_us[1]);
                w_found := b_found; vb_w := vb; tb_w := tb;
            END IF;
            IF NOT w_found THEN
                INSERT INTO txlimit_state (name, key, shard, value, ts)
                VALUES (p_row_name[r], p_row_key[r], p_row_shard[r], sv, 'epoch'::timestamptz + st * interval '1 microsecond')
                ON CONFLICT DO NOTHING;
                GET DIAGNOSTICS k = ROW_COUNT;
            ELSE
                -- Locked without waiting, and written, where it is still as read: a row another
                -- transaction holds is left to the general path, which takes the other pick when
                -- that one can serve alone.
                UPDATE txlimit_state s
                SET value = sv, ts = 'epoch'::timestamptz + st * interval '1 microsecond'
                WHERE s.ctid = (SELECT l.ctid FROM txlimit_state l
                                WHERE l.name = p_row_name[r] AND l.key = p_row_key[r] AND l.shard = p_row_shard[r]
                                  AND l.value = vb_w AND l.ts = 'epoch'::timestamptz + tb_w * interval '1 microsecond'
                                FOR UPDATE SKIP LOCKED);
                GET DIAGNOSTICS k = ROW_COUNT;
            END IF;
        END IF;
        IF NOT granted OR k = 1 THEN
            IF NOT granted THEN
                m_retry := txlimit_first_grant(kind, p_rate[1], p_period_us[1], p_cap[1], p_count[1], p_allow[1],
                                               two, va, ta, vb, tb, t_now);
            ELSIF NOT now_ok THEN
                m_retry := txlimit_first_grant(kind, p_rate[1], p_period_us[1], p_cap[1], 0, 0, false, sv, st, NULL, NULL, t_now);
            ELSE
                m_retry := 0;
            END IF;
            ok := now_ok; reserved := granted AND NOT now_ok; busy := false;
            level_sum := CASE WHEN granted THEN end_a + CASE WHEN two THEN end_b ELSE 0 END ELSE lv_a + lv_b END;
            shard_a := p_cand_shard[off + s_pos - 1]; shard_b := p_cand_shard[off + s_pos % cnt];
            charged := ch; retry_at_us := m_retry; now_us := t_now;
            RETURN NEXT;
            RETURN;
        END IF;
    END IF;

    -- The general path: the arrays of rows and requests.
    -- (As many groups as requests, by p_grp's numbering: each group is one request.)
    lean := p_cand_n <@ '{1}'::integer[] AND NOT (p_steer && '{true}'::boolean[])
            AND p_grp[n] = n - 1;
    -- A lean list whose rows each have one request (a batch of calls on keys of their own): when
    -- every request is granted now (not as a reservation, not a Check) by its row's latest version,
    -- one UPDATE in row order, with no read first, decides and writes them all; Postgres evaluates
    -- the rules on that version (re-read when another transaction changed it meanwhile), so each
    -- decision is the one the steps below would reach. When any request is not (a Check, a missing
    -- row, a refusal, a reservation), the UPDATE is undone, its row locks with it (a
    -- subtransaction), and the whole list goes on through the lean road: keeping some rows locked
    -- while the lean road locks others could take locks out of row order. The UPDATE is tried only
    -- when the request on the first row would be granted now on that row as read (one probe by its
    -- key), so that a list of refusals pays one probe, not the UPDATE; and only as the first write
    -- of its transaction (a Batcher's batch, say), so that a transaction holds at most one such
    -- subtransaction, whose ID is the one it costs beyond the transaction's own.
    IF lean AND m = n AND n > 1 AND NOT (p_dry && '{true}'::boolean[])
       AND pg_current_xact_id_if_assigned() IS NULL THEN
        i := array_position(p_cand_row, 1);
        SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO va, ta
        FROM txlimit_state s
        WHERE s.name = p_row_name[1] AND s.key = p_row_key[1] AND s.shard = p_row_shard[1];
        IF FOUND AND txlimit_granted(1, txlimit_left(0, 1, txlimit_level(p_kind[i], va, ta, t_now, p_rate[i], p_period_us[i],
                                                                         p_cap[i]), 0, p_count[i]), 0, 0) THEN
            BEGIN
                WITH w AS (
                    UPDATE txlimit_state s
                    SET value = txlimit_left(0, 1, txlimit_level(u.kind, s.value, (extract(epoch FROM s.ts) * 1000000)::bigint,
                                                                   t_now, u.rate, u.per, u.cap), 0, u.cnt),
                        ts = 'epoch'::timestamptz
                             + txlimit_next_ts(u.kind, (extract(epoch FROM s.ts) * 1000000)::bigint, t_now, u.per) * interval '1 microsecond'
                    FROM (SELECT * FROM unnest(p_cand_row, p_kind, p_rate, p_period_us, p_cap, p_count)
                                        WITH ORDINALITY AS v(r, kind, rate, per, cap, cnt, i)
                          ORDER BY v.r
                          OFFSET 0) u
                    WHERE s.name = p_row_name[u.r] AND s.key = p_row_key[u.r] AND s.shard = p_row_shard[u.r]
                      AND txlimit_granted(1, txlimit_left(0, 1, txlimit_level(u.kind, s.value, (extract(epoch FROM s.ts) * 1000000)::bigint,
                                                                              t_now, u.rate, u.per, u.cap), 0, u.cnt), 0, 0)
                    RETURNING u.i::integer AS i, s.value AS lvl
                )
                SELECT array_agg(w.i ORDER BY w.i), array_agg(w.lvl + 0 ORDER BY w.i) INTO f_i, f_lvl FROM w;
                IF cardinality(f_i) IS DISTINCT FROM n THEN
                    RAISE SQLSTATE 'TXLU0'; -- undo the UPDATE (caught just below)
                END IF;
                RETURN QUERY
                SELECT true, false, false, u.lvl, p_cand_shard[u.i], -1, 1, 0::bigint, t_now
                FROM unnest(f_i, f_lvl) AS u(i, lvl);
                RETURN;
            EXCEPTION WHEN SQLSTATE 'TXLU0' THEN
                NULL; -- not every request granted now: the lean road decides the list
            END;
        END IF;
    END IF;
    -- The lock-free read of every row a request without steering may use, in one statement (a
    -- single row by its key: cheaper than the join over arrays).
    IF m = 1 THEN
        SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO va, ta
        FROM txlimit_state s
        WHERE p_row_bulk[1] AND s.name = p_row_name[1] AND s.key = p_row_key[1] AND s.shard = p_row_shard[1];
        r_ex := ARRAY[FOUND]; r_val := ARRAY[va]; r_ts := ARRAY[ta];
    ELSE
        -- (One sort for the three arrays: an ORDER BY in each aggregate would sort three times.)
        SELECT array_agg(q.v IS NOT NULL), array_agg(q.v), array_agg(q.t)
        INTO r_ex, r_val, r_ts
        FROM (SELECT s.v, s.t
              FROM unnest(p_row_name, p_row_key, p_row_shard, p_row_bulk) WITH ORDINALITY AS u(nm, ky, sh, bulk, i)
              LEFT JOIN LATERAL (
                  SELECT s.value AS v, (extract(epoch FROM s.ts) * 1000000)::bigint AS t
                  FROM txlimit_state s
                  WHERE u.bulk AND s.name = u.nm AND s.key = u.ky AND s.shard = u.sh
                  OFFSET 0 -- kept a subquery, so that a row not to read is not looked up either
              ) s ON true
              ORDER BY u.i
              OFFSET 0) q;
    END IF;
    r_read := p_row_bulk;
    l_got := array_fill(false, ARRAY[m]);
    l_val := array_fill(0::double precision, ARRAY[m]);
    l_ts := array_fill(0::bigint, ARRAY[m]);
    w_val := array_fill(0::double precision, ARRAY[m]);
    w_ts := array_fill(0::bigint, ARRAY[m]);
    want := array_fill(false, ARRAY[m]);
    ph_val := array_fill(0::double precision, ARRAY[m]);
    ph_ts := array_fill(0::bigint, ARRAY[m]);
    o_ok := array_fill(false, ARRAY[n]);
    o_res := array_fill(false, ARRAY[n]);
    o_busy := array_fill(false, ARRAY[n]);
    o_lvl := array_fill(0::double precision, ARRAY[n]);
    o_sa := array_fill(-1, ARRAY[n]);
    o_sb := array_fill(-1, ARRAY[n]);
    o_ch := array_fill(0, ARRAY[n]);
    o_retry := array_fill(0::bigint, ARRAY[n]);
    IF NOT lean THEN
        q_a := array_fill(0, ARRAY[n]);
        q_b := array_fill(0, ARRAY[n]);
        q_two := array_fill(false, ARRAY[n]);
        q_charge := array_fill(0, ARRAY[n]);
        q_lva := array_fill(0::double precision, ARRAY[n]);
        q_lvb := array_fill(0::double precision, ARRAY[n]);
        q_ta := array_fill(0::bigint, ARRAY[n]);
        q_tb := array_fill(0::bigint, ARRAY[n]);
        q_held := array_fill(true, ARRAY[n]);
        q_planned := array_fill(false, ARRAY[n]);
        q_lvl := array_fill(0::double precision, ARRAY[n]);
        IF snap_iso THEN
            snap := pg_current_snapshot();
            xr := pg_snapshot_xmax(snap)::text::bigint;
        END IF;
        base := 'txlimit_state'::regclass::oid::bigint << 20;
    END IF;

    FOR pass IN 1 .. 2 LOOP
        w_mod := array_fill(false, ARRAY[m]);
        -- The lean loop: each request alone on its row, seeing the grants before it on that row.
        -- In the second pass a row is as locked when a request of the first was granted on it,
        -- and as read otherwise (so it is granted nothing then either).
        -- (One candidate per request: request i's candidate is element i.)
        IF lean THEN
            o_ch := array_fill(1, ARRAY[n]); o_sa := p_cand_shard;
        END IF;
        FOR i IN 1 .. CASE WHEN lean THEN n ELSE 0 END LOOP
            r := p_cand_row[i];
            CONTINUE WHEN pass = 2 AND done[r]; -- written in the first pass: its answers stand
            kind := p_kind[i];
            IF w_mod[r] THEN va := w_val[r]; ta := w_ts[r];
            ELSIF pass = 2 AND l_got[r] THEN va := l_val[r]; ta := l_ts[r];
            ELSIF r_ex[r] THEN va := r_val[r]; ta := r_ts[r];
            ELSE va := p_cap[i]; ta := txlimit_missing_ts(kind, p_anchor_us[i]);
            END IF;
            lv_a := txlimit_level(kind, va, ta, t_now, p_rate[i], p_period_us[i], p_cap[i]);
            end_a := txlimit_left(0, 1, lv_a, 0, p_count[i]);
            granted := txlimit_granted(1, end_a, 0, p_allow[i]);
            now_ok := txlimit_granted(1, end_a, 0, 0);
            o_ok[i] := now_ok; o_res[i] := granted AND NOT now_ok; o_retry[i] := 0; -- (set below when due)
            o_lvl[i] := CASE WHEN granted THEN end_a ELSE lv_a END + 0;
            IF granted AND NOT p_dry[i] AND pass = 2 AND NOT l_got[r] THEN
                -- Granted by the rules on a row another transaction holds: refused, to be retried
                -- at once.
                o_ok[i] := false; o_res[i] := false; o_retry[i] := t_now; o_lvl[i] := lv_a + 0;
                CONTINUE;
            END IF;
            IF granted AND NOT p_dry[i] THEN
                w_val[r] := end_a; w_ts[r] := txlimit_next_ts(kind, ta, t_now, p_period_us[i]); w_mod[r] := true;
                IF NOT want[r] THEN
                    want[r] := true; n_want := n_want + 1;
                    IF NOT r_ex[r] THEN -- to be created
                        ph_val[r] := p_cap[i]; ph_ts[r] := txlimit_missing_ts(kind, p_anchor_us[i]); n_new := n_new + 1;
                    END IF;
                END IF;
            END IF;
            -- RetryAt, for a refusal when the same request is granted, for a reservation when its
            -- debt is paid. A run of identical searches (a flood on one key) is done once.
            IF NOT now_ok THEN
                IF granted THEN
                    sv := end_a; st := txlimit_next_ts(kind, ta, t_now, p_period_us[i]); sc := 0; sa := 0;
                ELSE
                    sv := va; st := ta; sc := p_count[i]; sa := p_allow[i];
                END IF;
                IF NOT (m_r = r AND m_sv = sv AND m_st = st AND m_sc = sc AND m_sa = sa AND m_kind = kind
                        AND m_rate = p_rate[i] AND m_per = p_period_us[i] AND m_cap = p_cap[i]) THEN
                    -- Usually the estimate is exact (see the lone path); else the search finds it.
                    m_retry := txlimit_estimate(kind, p_rate[i], p_period_us[i], -end_a - sa,
                                                txlimit_next_ts(kind, ta, t_now, p_period_us[i]), t_now);
                    IF NOT txlimit_grant_starts_at(kind, p_rate[i], p_period_us[i], p_cap[i], sc, sa, sv, st, m_retry) THEN
                        m_retry := txlimit_first_grant(kind, p_rate[i], p_period_us[i], p_cap[i], sc, sa,
                                                       false, sv, st, NULL, NULL, t_now);
                    END IF;
                    m_r := r; m_sv := sv; m_st := st; m_sc := sc; m_sa := sa; m_kind := kind;
                    m_rate := p_rate[i]; m_per := p_period_us[i]; m_cap := p_cap[i];
                END IF;
                o_retry[i] := m_retry;
            END IF;
        END LOOP;
        g := CASE WHEN lean THEN n + 1 ELSE 1 END;
        WHILE g <= n LOOP
            g_end := g;
            WHILE g_end < n AND p_grp[g_end + 1] = p_grp[g] LOOP
                g_end := g_end + 1;
            END LOOP;
            g_ok := true;
            FOR i IN g .. g_end LOOP
                kind := p_kind[i]; dry := p_dry[i]; off := p_cand_off[i]; cnt := p_cand_n[i];
                mts := txlimit_missing_ts(kind, p_anchor_us[i]);
                IF pass = 1 THEN
                    -- Choose the rows.
                    pos := 1;
                    IF p_steer[i] AND NOT dry AND s_pos IS NOT NULL THEN
                        pos := s_pos; -- chosen by the lone steered road
                    ELSIF p_steer[i] AND NOT dry THEN
                        r := p_cand_row[off];
                        SELECT t.pos, t.found, t.value, t.ts_us INTO pos, r_found, va, ta
                        FROM txlimit_steer(p_lock_base[i] # base, p_cand_shard[off:off + cnt - 1], p_row_name[r], p_row_key[r],
                                           snap, xr) t;
                        IF snap_iso AND pos IS NOT NULL THEN -- the chosen row, as read while steering
                            r := p_cand_row[off + pos - 1];
                            r_read[r] := true; r_ex[r] := r_found; r_val[r] := va; r_ts[r] := ta;
                        END IF;
                        IF pos IS NULL AND snap_iso THEN
                            o_busy[i] := true; g_ok := false;
                            o_sa[i] := p_cand_shard[off]; o_sb[i] := p_cand_shard[off + 1];
                            CONTINUE;
                        END IF;
                        pos := coalesce(pos, 1);
                    END IF;
                    q_a[i] := p_cand_row[off + pos - 1];
                    IF cnt >= 2 THEN
                        q_b[i] := p_cand_row[off + pos % cnt];
                        o_sa[i] := p_cand_shard[off + pos - 1];
                        o_sb[i] := p_cand_shard[off + pos % cnt];
                    ELSE
                        o_sa[i] := p_cand_shard[off];
                    END IF;
                END IF;
                IF o_busy[i] THEN
                    g_ok := false;
                    CONTINUE;
                END IF;
                a := q_a[i]; b := q_b[i];
                -- Row a, read without a lock when this is its first use.
                IF NOT r_read[a] THEN
                    SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO va, ta
                    FROM txlimit_state s
                    WHERE s.name = p_row_name[a] AND s.key = p_row_key[a] AND s.shard = p_row_shard[a];
                    r_read[a] := true; r_ex[a] := FOUND; r_val[a] := va; r_ts[a] := ta;
                END IF;
                IF w_mod[a] THEN va := w_val[a]; ta := w_ts[a];
                ELSIF pass = 2 AND l_got[a] THEN va := l_val[a]; ta := l_ts[a];
                ELSIF r_ex[a] THEN va := r_val[a]; ta := r_ts[a];
                ELSE va := p_cap[i]; ta := mts;
                END IF;
                lv_a := txlimit_level(kind, va, ta, t_now, p_rate[i], p_period_us[i], p_cap[i]);
                IF pass = 1 THEN
                    -- Under a snapshot, a lone request reads b only when a cannot serve alone.
                    q_two[i] := b > 0 AND NOT (p_steer[i] AND snap_iso AND lv_a >= p_count[i]);
                END IF;
                two := q_two[i];
                lv_b := 0; vb := NULL; tb := NULL;
                IF two THEN
                    IF NOT r_read[b] THEN
                        SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO vb, tb
                        FROM txlimit_state s
                        WHERE s.name = p_row_name[b] AND s.key = p_row_key[b] AND s.shard = p_row_shard[b];
                        r_read[b] := true; r_ex[b] := FOUND; r_val[b] := vb; r_ts[b] := tb;
                    END IF;
                    IF w_mod[b] THEN vb := w_val[b]; tb := w_ts[b];
                    ELSIF pass = 2 AND l_got[b] THEN vb := l_val[b]; tb := l_ts[b];
                    ELSIF r_ex[b] THEN vb := r_val[b]; tb := r_ts[b];
                    ELSE vb := p_cap[i]; tb := mts;
                    END IF;
                    lv_b := txlimit_level(kind, vb, tb, t_now, p_rate[i], p_period_us[i], p_cap[i]);
                END IF;
                -- Decide: freely on the plan; in the second pass, a request whose group was planned
                -- granted keeps to the rows it holds (a lone request may have switched shards).
                fixed := 0;
                IF pass = 2 AND NOT dry AND q_planned[i] THEN
                    fixed := CASE WHEN l_got[a] THEN 1 ELSE 0 END + CASE WHEN two AND l_got[b] THEN 2 ELSE 0 END;
                END IF;
                ch := txlimit_charge(lv_a, lv_b, two, p_count[i], fixed);
                q_lva[i] := lv_a; q_lvb[i] := lv_b; q_ta[i] := ta; q_tb[i] := tb;
                end_a := txlimit_left(0, ch, lv_a, lv_b, p_count[i]);
                end_b := txlimit_left(1, ch, lv_a, lv_b, p_count[i]);
                granted := txlimit_granted(ch, end_a, end_b, p_allow[i]);
                IF pass = 1 THEN
                    q_charge[i] := ch;
                END IF;
                now_ok := txlimit_granted(ch, end_a, end_b, 0);
                -- Held: every row the request charges is locked by this transaction.
                q_held[i] := dry OR NOT ((ch IN (1, 3) AND NOT l_got[a]) OR (ch IN (2, 3) AND NOT l_got[b]));
                o_ok[i] := now_ok; o_res[i] := granted AND NOT now_ok; o_ch[i] := ch; o_retry[i] := 0;
                o_lvl[i] := CASE WHEN granted THEN end_a + CASE WHEN two THEN end_b ELSE 0 END
                                 ELSE lv_a + lv_b END;
                q_lvl[i] := lv_a + lv_b;
                IF NOT granted THEN
                    -- A run of identical refusals (a flood on one key) searches once.
                    IF m_key IS NOT DISTINCT FROM ROW(kind, p_rate[i], p_period_us[i], p_cap[i], p_count[i], p_allow[i],
                                                      two, va, ta, vb, tb) THEN
                        o_retry[i] := m_retry;
                    ELSE
                        o_retry[i] := txlimit_first_grant(kind, p_rate[i], p_period_us[i], p_cap[i], p_count[i], p_allow[i],
                                                          two, va, ta, vb, tb, t_now);
                        m_key := ROW(kind, p_rate[i], p_period_us[i], p_cap[i], p_count[i], p_allow[i], two, va, ta, vb, tb);
                        m_retry := o_retry[i];
                    END IF;
                ELSIF NOT now_ok THEN
                    IF ch IN (1, 3) THEN
                        o_retry[i] := txlimit_first_grant(kind, p_rate[i], p_period_us[i], p_cap[i], 0, 0, false,
                                                          end_a, txlimit_next_ts(kind, ta, t_now, p_period_us[i]), NULL, NULL, t_now);
                    END IF;
                    IF ch IN (2, 3) THEN
                        o_retry[i] := greatest(o_retry[i],
                            txlimit_first_grant(kind, p_rate[i], p_period_us[i], p_cap[i], 0, 0, false,
                                                end_b, txlimit_next_ts(kind, tb, t_now, p_period_us[i]), NULL, NULL, t_now));
                    END IF;
                END IF;
                g_ok := g_ok AND granted;
            END LOOP;

            -- Granted by the rules on rows this transaction does not hold (a concurrent transaction
            -- changed them between the passes): refused, to be retried at once.
            IF pass = 2 AND g_ok THEN
                FOR i IN g .. g_end LOOP
                    CONTINUE WHEN q_held[i];
                    g_ok := false;
                    o_ok[i] := false; o_res[i] := false; o_retry[i] := t_now; o_lvl[i] := q_lvl[i];
                END LOOP;
            END IF;

            -- A granted group: its effect is seen by the requests after it; in the first pass its
            -- rows are to be locked, in the second they are to be written.
            IF g_ok AND NOT p_dry[g] THEN
                FOR i IN g .. g_end LOOP
                    q_planned[i] := pass = 1;
                    a := q_a[i]; b := q_b[i];
                    ch := CASE WHEN pass = 1 THEN q_charge[i] ELSE o_ch[i] END;
                    IF ch IN (1, 3) THEN
                        w_val[a] := txlimit_left(0, ch, q_lva[i], q_lvb[i], p_count[i]);
                        w_ts[a] := txlimit_next_ts(p_kind[i], q_ta[i], t_now, p_period_us[i]);
                        w_mod[a] := true;
                        IF pass = 1 AND NOT want[a] THEN
                            want[a] := true; ph_val[a] := p_cap[i]; ph_ts[a] := txlimit_missing_ts(p_kind[i], p_anchor_us[i]);
                        END IF;
                    END IF;
                    IF ch IN (2, 3) THEN
                        w_val[b] := txlimit_left(1, ch, q_lva[i], q_lvb[i], p_count[i]);
                        w_ts[b] := txlimit_next_ts(p_kind[i], q_tb[i], t_now, p_period_us[i]);
                        w_mod[b] := true;
                        IF pass = 1 AND NOT want[b] THEN
                            want[b] := true; ph_val[b] := p_cap[i]; ph_ts[b] := txlimit_missing_ts(p_kind[i], p_anchor_us[i]);
                        END IF;
                    END IF;
                END LOOP;
            END IF;
            g := g_end + 1;
        END LOOP;

        EXIT WHEN pass = 2;

        -- A lean list whose rows to write all exist: one statement writes each where it is still as
        -- read, in row order (the write is the lock). A row changed meanwhile is not written: it is
        -- locked without waiting, so that no lock is awaited out of row order, and its requests
        -- are decided again on it in the second pass; a row another transaction holds meanwhile is
        -- refused to them, to be retried at once (an under-grant, never an over-grant).
        IF lean AND n_new = 0 AND n_want > 0 THEN
            -- One row to write (a batch on one key, say): by its key, cheaper than the join over
            -- arrays.
            IF n_want = 1 THEN
                r := array_position(w_mod, true);
                UPDATE txlimit_state s
                SET value = w_val[r], ts = 'epoch'::timestamptz + w_ts[r] * interval '1 microsecond'
                WHERE s.name = p_row_name[r] AND s.key = p_row_key[r] AND s.shard = p_row_shard[r]
                  AND s.value = r_val[r] AND s.ts = 'epoch'::timestamptz + r_ts[r] * interval '1 microsecond';
                GET DIAGNOSTICS k = ROW_COUNT;
                done_rows := CASE WHEN k = 1 THEN ARRAY[r] END;
            ELSE
                WITH w AS (
                    UPDATE txlimit_state s
                    SET value = u.v, ts = 'epoch'::timestamptz + u.t * interval '1 microsecond'
                    FROM unnest(p_row_name, p_row_key, p_row_shard, w_mod, w_val, w_ts, r_val, r_ts) WITH ORDINALITY
                         AS u(nm, ky, sh, md, v, t, rv, rt, i)
                    WHERE u.md AND s.name = u.nm AND s.key = u.ky AND s.shard = u.sh
                      AND s.value = u.rv AND s.ts = 'epoch'::timestamptz + u.rt * interval '1 microsecond'
                    RETURNING u.i
                )
                SELECT count(*), array_agg(w.i::integer) INTO k, done_rows FROM w;
            END IF;
            IF k = n_want THEN
                w_mod := array_fill(false, ARRAY[m]); -- written
                EXIT;
            END IF;
            done := array_fill(false, ARRAY[m]);
            FOREACH j IN ARRAY coalesce(done_rows, '{}') LOOP
                done[j] := true;
            END LOOP;
            FOR r IN 1 .. m LOOP
                CONTINUE WHEN NOT want[r] OR done[r];
                SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO va, ta
                FROM txlimit_state s
                WHERE s.name = p_row_name[r] AND s.key = p_row_key[r] AND s.shard = p_row_shard[r]
                FOR UPDATE SKIP LOCKED;
                IF FOUND THEN
                    l_got[r] := true; l_val[r] := va; l_ts[r] := ta;
                END IF;
            END LOOP;
            CONTINUE;
        END IF;
        -- The locks. A lone sharded request charging one shard tries it without waiting, then its
        -- other pick when that can serve alone, and waits only when both are held.
        IF n = 1 AND p_steer[1] AND q_two[1] AND q_charge[1] IN (1, 2) AND want[q_a[1]] <> want[q_b[1]] THEN
            pick := CASE WHEN q_charge[1] = 1 THEN q_a[1] ELSE q_b[1] END;
            other := CASE WHEN q_charge[1] = 1 THEN q_b[1] ELSE q_a[1] END;
            IF r_ex[pick] THEN
                SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO va, ta
                FROM txlimit_state s
                WHERE s.name = p_row_name[pick] AND s.key = p_row_key[pick] AND s.shard = p_row_shard[pick]
                FOR UPDATE SKIP LOCKED;
                IF FOUND THEN
                    l_got[pick] := true; l_val[pick] := va; l_ts[pick] := ta; want[pick] := false;
                    changed := changed OR va IS DISTINCT FROM r_val[pick] OR ta IS DISTINCT FROM r_ts[pick];
                ELSE
                    -- The other pick serves alone if its plan level holds the count.
                    IF r_ex[other] THEN
                        va := r_val[other]; ta := r_ts[other];
                    ELSE
                        va := p_cap[1]; ta := txlimit_missing_ts(p_kind[1], p_anchor_us[1]);
                    END IF;
                    IF txlimit_level(p_kind[1], va, ta, t_now, p_rate[1], p_period_us[1], p_cap[1]) >= p_count[1] THEN
                        IF r_ex[other] THEN
                            SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO va, ta
                            FROM txlimit_state s
                            WHERE s.name = p_row_name[other] AND s.key = p_row_key[other] AND s.shard = p_row_shard[other]
                            FOR UPDATE SKIP LOCKED;
                            IF FOUND THEN
                                l_got[other] := true; l_val[other] := va; l_ts[other] := ta; want[pick] := false;
                                changed := true;
                            END IF;
                        ELSE
                            changed := true;
                            want[pick] := false; want[other] := true;
                            ph_val[other] := p_cap[1]; ph_ts[other] := txlimit_missing_ts(p_kind[1], p_anchor_us[1]);
                        END IF;
                    END IF;
                END IF;
            END IF;
        END IF;
        -- Rows believed to exist are locked a run at a time (one statement, in row order, up to the
        -- next row to create); a row to create is inserted, and so locked, in its turn. A row of a
        -- run that was deleted since it was read is created right after its run.
        r := 1;
        WHILE r <= m LOOP
            e := r;
            IF want[r] AND r_ex[r] AND NOT l_got[r] THEN
                j := r; -- the run's last row to lock
                WHILE j < m AND (NOT want[j + 1] OR r_ex[j + 1]) LOOP
                    j := j + 1;
                    IF want[j] AND NOT l_got[j] THEN
                        e := j;
                    END IF;
                END LOOP;
            END IF;
            IF e > r THEN -- a run of two rows to lock or more (a single row is locked below)
                FOR rec IN
                    SELECT u.i::integer AS i, s.value AS v, (extract(epoch FROM s.ts) * 1000000)::bigint AS t
                    FROM unnest(p_row_name[r:e], p_row_key[r:e], p_row_shard[r:e], want[r:e], l_got[r:e])
                         WITH ORDINALITY AS u(nm, ky, sh, w, got, i)
                    JOIN txlimit_state s ON s.name = u.nm AND s.key = u.ky AND s.shard = u.sh
                    WHERE u.w AND NOT u.got
                    ORDER BY u.i
                    FOR UPDATE OF s
                LOOP
                    j := r + rec.i - 1;
                    l_got[j] := true; l_val[j] := rec.v; l_ts[j] := rec.t;
                    changed := changed OR rec.v IS DISTINCT FROM r_val[j] OR rec.t IS DISTINCT FROM r_ts[j];
                END LOOP;
                FOR j IN r .. e LOOP
                    IF want[j] AND NOT l_got[j] THEN
                        r_ex[j] := false;
                        changed := true;
                    END IF;
                END LOOP;
            END IF;
            IF want[r] AND NOT l_got[r] THEN
                tries := 0;
                LOOP
                    IF r_ex[r] OR tries > 0 THEN
                        SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO va, ta
                        FROM txlimit_state s
                        WHERE s.name = p_row_name[r] AND s.key = p_row_key[r] AND s.shard = p_row_shard[r]
                        FOR UPDATE;
                        IF FOUND THEN
                            l_got[r] := true; l_val[r] := va; l_ts[r] := ta;
                            changed := changed OR NOT r_ex[r] OR va IS DISTINCT FROM r_val[r] OR ta IS DISTINCT FROM r_ts[r];
                            EXIT;
                        END IF;
                    END IF;
                    INSERT INTO txlimit_state (name, key, shard, value, ts)
                    VALUES (p_row_name[r], p_row_key[r], p_row_shard[r], ph_val[r],
                            'epoch'::timestamptz + ph_ts[r] * interval '1 microsecond')
                    ON CONFLICT DO NOTHING;
                    GET DIAGNOSTICS k = ROW_COUNT;
                    IF k = 1 THEN
                        l_got[r] := true; l_val[r] := ph_val[r]; l_ts[r] := ph_ts[r];
                        EXIT;
                    END IF;
                    tries := tries + 1;
                    IF tries > 100 THEN
                        RAISE EXCEPTION 'txlimit: row (%, %, %) keeps appearing and vanishing', p_row_name[r], p_row_key[r], p_row_shard[r]
                            USING ERRCODE = '40001';
                    END IF;
                END LOOP;
            END IF;
            r := r + 1;
        END LOOP;
        EXIT WHEN NOT changed;
    END LOOP;

    -- The writes: every row a granted group changed, each through its whole primary key.
    k := cardinality(array_positions(w_mod, true));
    IF k = 1 THEN -- one row (the most common case): by its key, cheaper than the join over arrays
        r := array_position(w_mod, true);
        UPDATE txlimit_state s
        SET value = w_val[r], ts = 'epoch'::timestamptz + w_ts[r] * interval '1 microsecond'
        WHERE s.name = p_row_name[r] AND s.key = p_row_key[r] AND s.shard = p_row_shard[r];
        GET DIAGNOSTICS j = ROW_COUNT;
        IF j <> 1 THEN
            RAISE EXCEPTION 'txlimit: wrote % of 1 locked row', j;
        END IF;
    ELSIF k > 0 THEN
        UPDATE txlimit_state s
        SET value = u.v, ts = 'epoch'::timestamptz + u.t * interval '1 microsecond'
        FROM unnest(p_row_name, p_row_key, p_row_shard, w_mod, w_val, w_ts) AS u(nm, ky, sh, md, v, t)
        WHERE u.md AND s.name = u.nm AND s.key = u.ky AND s.shard = u.sh;
        GET DIAGNOSTICS j = ROW_COUNT;
        IF j <> k THEN
            RAISE EXCEPTION 'txlimit: wrote % of % locked rows', j, k;
        END IF;
    END IF;

    RETURN QUERY
    SELECT u.ok, u.res, u.busy, u.lvl, u.sa, u.sb, u.ch, u.retry, t_now
    FROM unnest(o_ok, o_res, o_busy, o_lvl, o_sa, o_sb, o_ch, o_retry) AS u(ok, res, busy, lvl, sa, sb, ch, retry);
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION txlimit_decide(timestamptz, integer[], double precision[], double precision[], boolean[], boolean[],
                             smallint[], double precision[], bigint[], double precision[], bigint[], bigint[],
                             integer[], integer[], integer[], integer[], text[], text[], integer[], boolean[]);
DROP FUNCTION txlimit_first_grant(smallint, double precision, bigint, double precision, double precision,
                                  double precision, boolean, double precision, bigint, double precision, bigint, bigint);
DROP FUNCTION txlimit_steer(bigint, integer[], text, text, pg_snapshot, bigint);
DROP FUNCTION txlimit_stale(bigint, bigint, pg_snapshot);
DROP FUNCTION txlimit_xid8(bigint, bigint);
DROP FUNCTION txlimit_grant_starts_at(smallint, double precision, bigint, double precision, double precision,
                                      double precision, double precision, bigint, bigint);
DROP FUNCTION txlimit_estimate(smallint, double precision, bigint, double precision, bigint, bigint);
DROP FUNCTION txlimit_granted(integer, double precision, double precision, double precision);
DROP FUNCTION txlimit_left(integer, integer, double precision, double precision, double precision);
DROP FUNCTION txlimit_charge(double precision, double precision, boolean, double precision, integer);
DROP FUNCTION txlimit_missing_ts(smallint, bigint);
DROP FUNCTION txlimit_next_ts(smallint, bigint, bigint, bigint);
DROP FUNCTION txlimit_level(smallint, double precision, bigint, bigint, double precision, bigint, double precision);
DROP TABLE txlimit_state;
