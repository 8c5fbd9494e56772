-- +goose Up

-- The decision. Every call of the library is one statement: a list of one request, given as
-- scalars, is txlimit_decide_one_v1, after, for a Limit on an unsharded limit, the one UPDATE of
-- its row that the statement DecideOneRow (internal/dbsqlc/queries/engine.sql) tries first; a
-- list, given as parallel arrays, is txlimit_decide_v1. All take the one road: plan on lock-free
-- reads, lock the rows in the global order (name, key, shard, as bytes), decide on what is locked,
-- write. Where a request is alone on one row, the lock, the decision and the write are one UPDATE
-- of that row whose condition is the grant rule: its scan reads the row as the plan does, and when
-- another transaction changed the row meanwhile Postgres locks the latest version and evaluates
-- the rule again on it, so that the request is decided on the row it holds. A request that UPDATE
-- does not write (refused, or its row missing) goes on through the steps below. Entry points carry
-- a version in their name (see CONTRIBUTING.md). Every row access is a primary-key probe
-- (sequential scans are off for these functions), so under SERIALIZABLE a decision holds tuple or
-- page predicate locks only.

-- txlimit_stale: whether a row whose xmax is xm (a 32-bit transaction ID; 0 or NULL: none) was
-- written or locked by a transaction that the snapshot snap cannot see, in progress or committed
-- after snap was taken (xr: snap's xmax as a number, next to which xm is widened to 64 bits).
-- Under REPEATABLE READ or SERIALIZABLE, locking such a row could only fail, so steering passes
-- over it. (One expression without FROM, so that Postgres inlines it into txlimit_steer: as a query
-- of its own, run through the SQL-function executor, it cost over a third of a sharded decision
-- under SERIALIZABLE.)
-- +goose StatementBegin
CREATE FUNCTION txlimit_stale(xm bigint, xr bigint, snap pg_snapshot)
RETURNS boolean LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(xm, 0) <> 0
           AND xr + ((xm - (xr & 4294967295)) % 4294967296 + 4294967296 + 2147483648) % 4294967296 - 2147483648 >= 3
           AND NOT pg_visible_in_snapshot((xr + ((xm - (xr & 4294967295)) % 4294967296 + 4294967296 + 2147483648)
                                                % 4294967296 - 2147483648)::text::xid8, snap)
           AND (xr + ((xm - (xr & 4294967295)) % 4294967296 + 4294967296 + 2147483648) % 4294967296 - 2147483648 >= xr
                OR pg_xact_status((xr + ((xm - (xr & 4294967295)) % 4294967296 + 4294967296 + 2147483648)
                                   % 4294967296 - 2147483648)::text::xid8) IS DISTINCT FROM 'aborted')
$$;
-- +goose StatementEnd

-- txlimit_pack_v1: the answer to one request as 48 bytes, each number in network byte order: flags
-- (int4: 1 ok, granted now; 2 reserved, granted below zero; 4 busy, a lone sharded request under a
-- snapshot isolation level whose candidate shards were all taken: nothing written),
-- level_sum (float8: the tokens of the rows looked at, after the charge when granted, before it
-- when not), shard_a, shard_b (-1 when unsharded), charged (1: a, 2: b, 3: both) (int4 each),
-- retry_at_us (0 when granted now; for a reservation when its debt is paid, for a refusal when the
-- same request is granted: see txlimit_retry_at), now_us (the clock reading), ts_us (a grant
-- charging one row: the ts it left) (int8 each). (Bytes cost Postgres and the client less to pass
-- than a row or an array.)
-- +goose StatementBegin
CREATE FUNCTION txlimit_pack_v1(ok boolean, reserved boolean, busy boolean, level_sum double precision, shard_a integer,
                                shard_b integer, charged integer, retry_at_us bigint, now_us bigint, ts_us bigint)
RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT int4send(ok::integer + 2 * reserved::integer + 4 * busy::integer) || float8send(level_sum)
           || int4send(shard_a) || int4send(shard_b) || int4send(charged) || int8send(retry_at_us)
           || int8send(now_us) || int8send(ts_us)
$$;
-- +goose StatementEnd

-- txlimit_written_v1: the answer (txlimit_pack_v1) to a request granted by charging one row,
-- written to (v, ts_us) at t_us: granted when v >= 0, else reserved until retry_at_us, when the row
-- is out of debt (txlimit_debt_until, 0 when v >= 0); level_sum adds other_level, what the other
-- pick of a sharded limit holds (0 when unsharded, other_shard -1).
-- +goose StatementBegin
CREATE FUNCTION txlimit_written_v1(v double precision, ts_us bigint, t_us bigint, shard integer, other_shard integer,
                                   other_level double precision, retry_at_us bigint)
RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT txlimit_pack_v1(v >= 0, v < 0, false, v + other_level, shard, other_shard, 1, retry_at_us, t_us, ts_us)
$$;
-- +goose StatementEnd

-- txlimit_steer: where a lone request on a sharded limit starts among its candidate shards (its
-- position in p_shards: a is that candidate, b the one after it), so that concurrent callers of one
-- key are steered apart before they read a row: the first candidate whose transaction-scoped
-- advisory lock (p_lock_key XOR the table's OID shifted left 20 bits XOR the shard: tried, waited
-- for only as below, held until the transaction ends) this transaction gets and, under REPEATABLE READ or
-- SERIALIZABLE (p_snapshot), whose row is not stale (locking it from this snapshot could only
-- fail; this transaction's own writes and locks never make it stale). When every candidate is taken, under READ COMMITTED the answer is -1: go on with the
-- first; there a call whose plan grants and whose transaction has no transaction ID yet (it holds
-- no row lock: a call on the pool, say) first waits, a bounded time, for that candidate's advisory
-- lock (txlimit_await_shard) and plans again, so that it reads the shard as its holder left it
-- instead of waiting for the row, finding it changed and deciding again (docs/design-history.md,
-- 2026-11-27, measured it); a refusal waits for nothing, and a transaction that holds rows may wait
-- for the row itself, as any SQL does, never for an advisory lock, where it could close a deadlock
-- with what it holds. Under a snapshot the answer is 0: busy, having written nothing.
-- +goose StatementBegin
CREATE FUNCTION txlimit_steer(p_name text, p_key text, p_shards integer[], p_lock_key bigint, p_snapshot boolean)
RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    snap pg_snapshot; xr bigint; xm bigint; xn bigint; own bigint;
    lock_key bigint := p_lock_key # ('txlimit_state'::regclass::oid::bigint << 20);
BEGIN
    IF p_snapshot THEN
        snap := pg_current_snapshot();
        xr := pg_snapshot_xmax(snap)::text::bigint;
        own := pg_current_xact_id_if_assigned()::text::bigint % 4294967296; -- as xmax shows it
    END IF;
    FOR j IN 1 .. cardinality(p_shards) LOOP
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(lock_key # p_shards[j]::bigint);
        IF p_snapshot THEN
            SELECT s.xmax::text::bigint, s.xmin::text::bigint INTO xm, xn
            FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard = p_shards[j];
            -- Not stale when the xmax is this transaction's own (it holds the row: a Credit, a
            -- charge before), nor when the version read is its own write (a version this snapshot
            -- sees whose xmin it cannot see is this transaction's, a savepoint's included).
            CONTINUE WHEN txlimit_stale(xm, xr, snap) AND xm IS DISTINCT FROM own
                          AND NOT txlimit_stale(xn, xr, snap);
        END IF;
        RETURN j;
    END LOOP;
    RETURN CASE WHEN p_snapshot THEN 0 ELSE -1 END;
END
$$;
-- +goose StatementEnd

-- txlimit_await_shard: waits for the steering lock of shard p_shard (p_lock_key as in
-- txlimit_steer, which says when), for at most 100 ms, or the transaction's own lock_timeout when
-- that is shorter (lock_timeout is shown in the largest unit that divides it: below 100 ms only
-- as "<n>ms"); a wait that times out goes on without the lock (it is a hint, not a guard). The
-- bound keeps a wait for a holder that does not hold the shard's row (one whose call was refused,
-- or charged its other pick) from lasting its whole transaction, and keeps such waits from closing
-- a deadlock that only Postgres's detector could break (it looks after deadlock_timeout, 1 s).
-- +goose StatementBegin
CREATE FUNCTION txlimit_await_shard(p_lock_key bigint, p_shard integer)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    own text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', CASE WHEN own ~ '^[1-9][0-9]?ms$' THEN own ELSE '100ms' END, true);
    BEGIN
        PERFORM pg_advisory_xact_lock(p_lock_key # ('txlimit_state'::regclass::oid::bigint << 20) # p_shard::bigint);
    EXCEPTION WHEN lock_not_available THEN
        NULL; -- waited long enough: the shard's row decides from here
    END;
    PERFORM set_config('lock_timeout', own, true);
END
$$;
-- +goose StatementEnd

-- txlimit_create_key: the transaction-scoped advisory lock that a transaction creating the row
-- (name, key, shard) holds (txlimit_lock_row's p_create_key): a hash of the row and the table's
-- OID, so that schemas do not share them. txlimit_hold_shards (00004) takes it to wait for a
-- creator.
-- +goose StatementBegin
CREATE FUNCTION txlimit_create_key(p_name text, p_key text, p_shard integer)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT hashtextextended(p_key, hashtext(p_name)) # p_shard # ('txlimit_state'::regclass::oid::bigint << 20)
$$;
-- +goose StatementEnd

-- txlimit_lock_row: step 2 for one row: lock it (FOR UPDATE, which re-reads its latest version),
-- or, when it is missing, create it stamped as missing (full at its anchor: p_value, p_ts; created)
-- and so hold it. With p_try, nothing is waited for (a row that sorts before one this call already holds,
-- so that no lock is awaited out of the global order): got is false when another transaction holds
-- or is creating the row. Only one transaction at a time creates a row (p_create_key, a
-- transaction-scoped advisory lock: a hash of the row and the table's OID, so that schemas do not
-- share them), so that an insert never waits for another transaction's.
-- +goose StatementBegin
CREATE FUNCTION txlimit_lock_row(p_name text, p_key text, p_shard integer, p_value double precision, p_ts bigint,
                                 p_try boolean, p_create_key bigint,
                                 OUT got boolean, OUT value double precision, OUT ts bigint, OUT created boolean)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    k integer;
BEGIN
    got := false; created := false;
    FOR tries IN 1 .. 100 LOOP
        IF p_try THEN
            SELECT s.value, s.ts INTO value, ts FROM txlimit_state s
            WHERE s.name = p_name AND s.key = p_key AND s.shard = p_shard FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                got := true; RETURN;
            END IF;
            PERFORM FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard = p_shard;
            IF FOUND OR NOT pg_try_advisory_xact_lock(p_create_key) THEN
                RETURN; -- held or being created by another transaction
            END IF;
        ELSE
            SELECT s.value, s.ts INTO value, ts FROM txlimit_state s
            WHERE s.name = p_name AND s.key = p_key AND s.shard = p_shard FOR UPDATE;
            IF FOUND THEN
                got := true; RETURN;
            END IF;
            PERFORM pg_advisory_xact_lock(p_create_key);
        END IF;
        INSERT INTO txlimit_state (name, key, shard, value, ts) VALUES (p_name, p_key, p_shard, p_value, p_ts)
        ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS k = ROW_COUNT;
        IF k = 1 THEN
            got := true; value := p_value; ts := p_ts; created := true; RETURN;
        END IF;
        -- Created and committed meanwhile by another transaction: lock it.
    END LOOP;
    RAISE EXCEPTION 'txlimit: row (%, %, %) keeps appearing and vanishing', p_name, p_key, p_shard
        USING ERRCODE = '40001';
END
$$;
-- +goose StatementEnd

-- txlimit_answer_v1: the answer to request i of a list (its place, from 1), as txlimit_pack_v1's
-- bytes.
-- +goose StatementBegin
CREATE TYPE txlimit_answer_v1 AS (i integer, answer bytea);
-- +goose StatementEnd

-- txlimit_answers: step 5 of a list: the answer to each request, from the rows it was
-- decided on: for a request the first step wrote (w), the value and ts it left (q_va, q_ta);
-- otherwise the rows as evaluated (va, ta and, when sharded, vb, tb), its charge, whether the rules
-- grant it (ok) and whether it is refused to retry at once because it would be granted on a row
-- this call does not hold (now). Each step of its query ends in OFFSET 0, which keeps Postgres from
-- merging it into the next: merged, each level would be computed again wherever it is used;
-- MATERIALIZED, every row would be copied through a tuplestore (13,000 instructions more per
-- request, bench/callgrind.sh).
-- +goose StatementBegin
CREATE FUNCTION txlimit_answers(t bigint, p_count double precision[], p_allow double precision[],
                                p_step_us bigint[], p_rate double precision[], p_period_us bigint[],
                                p_cap double precision[], p_row_a integer[], p_row_b integer[], p_row_shard integer[],
                                q_w boolean[], q_va double precision[], q_ta bigint[], q_vb double precision[],
                                q_tb bigint[], q_ch integer[], q_ok boolean[], q_now boolean[])
RETURNS SETOF txlimit_answer_v1
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    RETURN QUERY
    WITH q AS (
        SELECT r.i, p_rate[r.i] AS rate, p_period_us[r.i] AS per, p_step_us[r.i] AS step, p_cap[r.i] AS cap,
               p_count[r.i] AS cnt, p_allow[r.i] AS alw, p_row_b[r.i] > 0 AS two, coalesce(q_w[r.i], false) AS w,
               q_va[r.i] AS va, q_ta[r.i] AS ta, q_vb[r.i] AS vb, q_tb[r.i] AS tb, q_ch[r.i] AS ch,
               q_ok[r.i] AND NOT coalesce(q_now[r.i], false) AS ok, coalesce(q_now[r.i], false) AS now
        FROM generate_series(1, cardinality(p_count)) AS r(i) OFFSET 0
    ), e AS (
        SELECT q.*, l.lva, l.lvb, txlimit_left(0, q.ch, l.lva, l.lvb, q.cnt) AS ea,
               txlimit_left(1, q.ch, l.lva, l.lvb, q.cnt) AS eb, txlimit_next_ts(q.ta, t, q.step) AS na,
               txlimit_next_ts(q.tb, t, q.step) AS nb
        FROM q, LATERAL (SELECT CASE WHEN q.w THEN q.va + q.cnt
                                     ELSE txlimit_level(q.va, q.ta, t, q.rate, q.per, q.step, q.cap) END AS lva,
                                CASE WHEN q.two THEN txlimit_level(q.vb, q.tb, t, q.rate, q.per, q.step, q.cap)
                                     ELSE 0 END AS lvb OFFSET 0) l
        OFFSET 0
    )
    SELECT e.i, CASE WHEN e.w THEN txlimit_written_v1(e.va, e.ta, t, p_row_shard[p_row_a[e.i]], -1, 0,
                                                      txlimit_debt_until(e.va, e.ta, t, e.rate, e.per, e.step, e.cap))
           ELSE txlimit_pack_v1(
               e.ok AND g.now_ok, e.ok AND NOT g.now_ok, false,
               CASE WHEN e.ok THEN e.ea + CASE WHEN e.two THEN e.eb ELSE 0 END ELSE e.lva + e.lvb END,
               p_row_shard[p_row_a[e.i]], CASE WHEN e.two THEN p_row_shard[p_row_b[e.i]] ELSE -1 END, e.ch,
               CASE WHEN e.now THEN t
                    WHEN NOT e.ok THEN txlimit_retry_at(e.rate, e.per, e.step, e.cap, e.cnt, e.alw, e.two, e.va, e.ta, e.vb,
                                                        e.tb, t)
                    WHEN g.now_ok THEN 0
                    ELSE greatest(CASE WHEN e.ch <> 2 THEN txlimit_retry_at(e.rate, e.per, e.step, e.cap, 0, 0, false,
                                                                           e.ea, e.na, NULL, NULL, t) END,
                                  CASE WHEN e.ch <> 1 THEN txlimit_retry_at(e.rate, e.per, e.step, e.cap, 0, 0, false,
                                                                           e.eb, e.nb, NULL, NULL, t) END) END,
               t, CASE WHEN e.ok AND e.ch = 1 THEN e.na WHEN e.ok AND e.ch = 2 THEN e.nb ELSE 0 END) END
    FROM e CROSS JOIN LATERAL (SELECT txlimit_granted(e.ch, e.ea, e.eb, 0) AS now_ok) g;
END
$$;
-- +goose StatementEnd

-- txlimit_alone: the first step of a list for its requests alone on their rows (p_fast: a group
-- of one request, the only one on its row in the list, not dry). One UPDATE, in row order, writes
-- each row whose latest version the rule grants its request on (see the top of this file). When it
-- wrote every request of the list (all_written), f_i, f_v and f_ts are the written requests and the
-- rows as written, and nothing else is read. Otherwise a fast request not written is decided on its
-- row as read now (the plan) when the rule refuses it there, and the arrays, indexed by the place
-- in the list, say for each request decided so: not todo; q_w, written; q_va, q_ta, its row as
-- written or as read (a missing row: NULL); q_ok, granted. e is the last row the UPDATE may hold:
-- one it wrote, or one the read found (a row missing there, another transaction creating it, the
-- UPDATE did not lock, so the steps after it may wait for it). It runs under txlimit_decide_v1's
-- planner settings.
-- +goose StatementBegin
CREATE FUNCTION txlimit_alone(t bigint, p_fast boolean[], p_row_a integer[], p_count double precision[],
                              p_allow double precision[], p_step_us bigint[], p_rate double precision[],
                              p_period_us bigint[], p_cap double precision[], p_row_name text[], p_row_key text[],
                              p_row_shard integer[], OUT all_written boolean, OUT f_i integer[],
                              OUT f_v double precision[], OUT f_ts bigint[], OUT todo boolean[], OUT q_w boolean[],
                              OUT q_va double precision[], OUT q_ta bigint[], OUT q_ok boolean[], OUT e integer)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    n integer := cardinality(p_fast);
    f_w boolean[]; f_dec boolean[];
BEGIN
    WITH f AS MATERIALIZED (
        SELECT * FROM unnest(p_fast, p_row_a, p_count, p_allow, p_step_us, p_rate, p_period_us, p_cap)
                      WITH ORDINALITY AS v(fast, r, cnt, alw, step, rate, per, cap, i)
        WHERE v.fast ORDER BY v.r
    ), u AS (
        UPDATE txlimit_state s
        SET value = txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, f.rate, f.per, f.step, f.cap), 0, f.cnt),
            ts = txlimit_next_ts(s.ts, t, f.step)
        FROM f
        WHERE s.name = p_row_name[f.r] AND s.key = p_row_key[f.r] AND s.shard = p_row_shard[f.r]
          AND txlimit_granted(1, txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, f.rate, f.per, f.step, f.cap),
                                              0, f.cnt), 0, f.alw)
        RETURNING f.i::integer AS i, s.value, s.ts
    )
    SELECT array_agg(u.i), array_agg(u.value), array_agg(u.ts) INTO f_i, f_v, f_ts FROM u;
    all_written := coalesce(cardinality(f_i), 0) = n;
    IF all_written THEN
        RETURN;
    END IF;
    SELECT array_agg(x.i), array_agg(x.w), array_agg(x.v), array_agg(x.ts), array_agg(x.decided),
           max(x.r) FILTER (WHERE x.found)
    INTO f_i, f_w, f_v, f_ts, f_dec, e
    FROM (SELECT v.i::integer AS i, w.p IS NOT NULL AS w, coalesce(f_v[w.p], r.value) AS v,
                 w.p IS NOT NULL OR r.value IS NOT NULL AS found,
                 coalesce(f_ts[w.p], r.ts) AS ts,
                 w.p IS NOT NULL OR NOT txlimit_granted(1, txlimit_left(0, 1, txlimit_level(r.value, r.ts, t,
                     p_rate[v.i], p_period_us[v.i], p_step_us[v.i], p_cap[v.i]), 0, p_count[v.i]), 0, p_allow[v.i])
                     AS decided,
                 p_row_a[v.i] AS r
          FROM unnest(p_fast) WITH ORDINALITY AS v(fast, i)
          -- w.p: the request's place among those written. (A join with unnest(f_i) would be a nested
          -- loop, every request against every write: 40% of a mixed list of 128.)
          CROSS JOIN LATERAL (SELECT array_position(f_i, v.i::integer) AS p OFFSET 0) w
          LEFT JOIN LATERAL (SELECT s.value, s.ts FROM txlimit_state s
                             WHERE w.p IS NULL AND s.name = p_row_name[p_row_a[v.i]] AND s.key = p_row_key[p_row_a[v.i]]
                               AND s.shard = p_row_shard[p_row_a[v.i]] OFFSET 0) r ON true
          WHERE v.fast ORDER BY v.i) x;
    todo := array_fill(true, ARRAY[n]);
    IF cardinality(f_i) = n THEN -- every request is fast: f_i is 1 .. n
        q_w := f_w; q_va := f_v; q_ta := f_ts; q_ok := f_w; todo := array_fill(false, ARRAY[n]);
        IF f_dec @> '{false}'::boolean[] THEN
            FOR k IN 1 .. n LOOP
                CONTINUE WHEN f_dec[k];
                todo[k] := true; q_w[k] := NULL; q_va[k] := NULL; q_ta[k] := NULL; q_ok[k] := NULL;
            END LOOP;
        END IF;
    ELSE
        FOR k IN 1 .. cardinality(f_i) LOOP
            CONTINUE WHEN NOT f_dec[k];
            todo[f_i[k]] := false; q_w[f_i[k]] := f_w[k]; q_va[f_i[k]] := f_v[k]; q_ta[f_i[k]] := f_ts[k];
            q_ok[f_i[k]] := f_w[k];
        END LOOP;
    END IF;
END
$$;
-- +goose StatementEnd

-- txlimit_decide_v1 decides a list of requests (a Batcher's batch, a LimitMany, a list of one that
-- txlimit_decide_one_v1 could not finish) and returns one answer per request (txlimit_answer_v1,
-- in no particular order: i is the request's place in the list). The caller (ratelimit/engine.go)
-- numbers the rows the list may touch in the global lock order and gives each request its
-- candidate rows, row_a and row_b (0 when unsharded). Requests: p_grp (all-or-nothing groups,
-- numbered in list order, a group's requests consecutive), count, allow (how far below zero a
-- charged row may go: 0 without Reserve, MaxReserved per shard with it, +Infinity for no bound), dry
-- (Check), fast (a group of one request, alone on its row in the list, not dry), and the config per
-- shard. p_held: the last row (in that order) the call may hold already.
-- +goose StatementBegin
CREATE FUNCTION txlimit_decide_v1(
    p_now_us bigint, p_grp integer[], p_count double precision[], p_allow double precision[], p_dry boolean[],
    p_fast boolean[], p_step_us bigint[], p_rate double precision[], p_period_us bigint[], p_cap double precision[],
    p_anchor_us bigint[], p_row_a integer[], p_row_b integer[],
    p_row_name text[], p_row_key text[], p_row_shard integer[], p_held integer)
RETURNS SETOF txlimit_answer_v1
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    -- (Defaults only for what every call needs: PL/pgSQL evaluates each at every call. The rest is
    -- set after the first step, which answers most lists alone.)
    t bigint := txlimit_clock(p_now_us);
    n integer := cardinality(p_grp); m integer;
    todo boolean[]; held integer := p_held;
    -- Rows as read, then as locked (r_*); as the granted groups leave them (w_*; w_req, the first
    -- granted request that charges the row, whose config stamps it if missing); held.
    r_val double precision[]; r_ts bigint[]; w_val double precision[]; w_ts bigint[]; w_req integer[];
    l_held boolean[]; lk record; changed boolean; made boolean;
    -- Requests: written by the first step, the rows as evaluated, the charge, granted by the rules,
    -- refused to retry at once.
    q_w boolean[]; q_va double precision[]; q_ta bigint[]; q_vb double precision[]; q_tb bigint[];
    q_ch integer[]; q_ok boolean[]; q_now boolean[]; plan_ch integer[];
    g integer; e integer; a integer; b integer; lv_a double precision; lv_b double precision;
    rules_ok boolean; g_ok boolean;
    all_w boolean; f_i integer[]; f_v double precision[]; f_ts bigint[]; -- the requests txlimit_alone wrote
BEGIN
    -- The requests alone on their rows: one UPDATE writes those the rule grants (txlimit_alone).
    IF p_fast && '{true}'::boolean[] THEN
        SELECT x.all_written, x.f_i, x.f_v, x.f_ts, x.todo, x.q_w, x.q_va, x.q_ta, x.q_ok, x.e
        INTO all_w, f_i, f_v, f_ts, todo, q_w, q_va, q_ta, q_ok, e
        FROM txlimit_alone(t, p_fast, p_row_a, p_count, p_allow, p_step_us, p_rate, p_period_us, p_cap, p_row_name,
                           p_row_key, p_row_shard) x;
        IF all_w THEN -- every request is alone on its row and written: the answers are the writes
            RETURN QUERY SELECT w.i, txlimit_written_v1(w.v, w.ts, t, p_row_shard[p_row_a[w.i]], -1, 0,
                                                        txlimit_debt_until(w.v, w.ts, t, p_rate[w.i], p_period_us[w.i],
                                                                           p_step_us[w.i], p_cap[w.i]))
                         FROM unnest(f_i, f_v, f_ts) AS w(i, v, ts);
            RETURN;
        END IF;
        q_ch := array_fill(1, ARRAY[n]);
        held := greatest(held, e);
        IF NOT todo @> '{true}'::boolean[] THEN
            RETURN QUERY SELECT * FROM txlimit_answers(t, p_count, p_allow, p_step_us, p_rate, p_period_us, p_cap,
                p_row_a, p_row_b, p_row_shard, q_w, q_va, q_ta, q_vb, q_tb, q_ch, q_ok, q_now);
            RETURN;
        END IF;
    END IF;

    m := cardinality(p_row_name); todo := coalesce(todo, array_fill(true, ARRAY[n]));
    plan_ch := array_fill(0, ARRAY[n]); changed := false; made := false;
    -- 1. Plan: every row read without a lock, and the list folded on them: each request left to
    -- decide, in list order, each all-or-nothing group seeing the groups granted before it.
    SELECT array_agg(s.value ORDER BY u.i), array_agg(s.ts ORDER BY u.i) INTO r_val, r_ts
    FROM unnest(p_row_name, p_row_key, p_row_shard) WITH ORDINALITY AS u(nm, ky, sh, i)
    LEFT JOIN LATERAL (SELECT s.value, s.ts FROM txlimit_state s
                       WHERE s.name = u.nm AND s.key = u.ky AND s.shard = u.sh OFFSET 0) s ON true;
    FOR pass IN 1 .. 2 LOOP
        w_val := r_val; w_ts := r_ts; w_req := array_fill(NULL::integer, ARRAY[m]);
        g := 1;
        WHILE g <= n LOOP
            e := g; -- the group: requests g .. e
            WHILE e < n AND p_grp[e + 1] = p_grp[g] LOOP
                e := e + 1;
            END LOOP;
            rules_ok := true; g_ok := true;
            FOR i IN g .. e LOOP
                CONTINUE WHEN NOT todo[i];
                a := p_row_a[i]; b := p_row_b[i];
                q_va[i] := coalesce(w_val[a], p_cap[i]); q_ta[i] := coalesce(w_ts[a], p_anchor_us[i]); -- missing: full
                lv_a := txlimit_level(q_va[i], q_ta[i], t, p_rate[i], p_period_us[i], p_step_us[i], p_cap[i]);
                lv_b := 0;
                IF b > 0 THEN
                    q_vb[i] := coalesce(w_val[b], p_cap[i]); q_tb[i] := coalesce(w_ts[b], p_anchor_us[i]);
                    lv_b := txlimit_level(q_vb[i], q_tb[i], t, p_rate[i], p_period_us[i], p_step_us[i], p_cap[i]);
                END IF;
                -- In the decision, a request the plan granted keeps to the rows it holds; one the
                -- rules grant on a row this call does not hold is refused, to retry at once.
                q_ch[i] := txlimit_charge(lv_a, lv_b, b > 0, p_count[i], CASE WHEN pass = 2 AND plan_ch[i] > 0
                    THEN (CASE WHEN l_held[a] THEN 1 ELSE 0 END) + (CASE WHEN b > 0 AND l_held[b] THEN 2 ELSE 0 END) ELSE 0 END);
                q_ok[i] := txlimit_granted(q_ch[i], txlimit_left(0, q_ch[i], lv_a, lv_b, p_count[i]),
                                           txlimit_left(1, q_ch[i], lv_a, lv_b, p_count[i]), p_allow[i]);
                q_now[i] := pass = 2 AND q_ok[i] AND NOT p_dry[i]
                            AND ((q_ch[i] <> 2 AND NOT l_held[a]) OR (q_ch[i] <> 1 AND NOT l_held[b]));
                rules_ok := rules_ok AND q_ok[i]; g_ok := g_ok AND NOT q_now[i];
            END LOOP;
            IF rules_ok AND g_ok THEN -- its rows as it leaves them, seen by the groups after it
                FOR i IN g .. e LOOP
                    CONTINUE WHEN NOT todo[i] OR p_dry[i];
                    IF pass = 1 THEN
                        plan_ch[i] := q_ch[i];
                    END IF;
                    a := p_row_a[i]; b := p_row_b[i];
                    lv_a := txlimit_level(q_va[i], q_ta[i], t, p_rate[i], p_period_us[i], p_step_us[i], p_cap[i]);
                    lv_b := 0;
                    IF b > 0 THEN
                        lv_b := txlimit_level(q_vb[i], q_tb[i], t, p_rate[i], p_period_us[i], p_step_us[i], p_cap[i]);
                    END IF;
                    IF q_ch[i] <> 2 THEN
                        w_val[a] := txlimit_left(0, q_ch[i], lv_a, lv_b, p_count[i]);
                        w_ts[a] := txlimit_next_ts(q_ta[i], t, p_step_us[i]); w_req[a] := coalesce(w_req[a], i);
                    END IF;
                    IF q_ch[i] <> 1 THEN
                        w_val[b] := txlimit_left(1, q_ch[i], lv_a, lv_b, p_count[i]);
                        w_ts[b] := txlimit_next_ts(q_tb[i], t, p_step_us[i]); w_req[b] := coalesce(w_req[b], i);
                    END IF;
                END LOOP;
            ELSIF NOT rules_ok THEN
                q_now[g:e] := array_fill(false, ARRAY[e - g + 1]); -- refused by the rules: no retry at once
            END IF;
            g := e + 1;
        END LOOP;
        EXIT WHEN pass = 2;

        -- 2. Lock, in row order, the rows the granted groups charge; a missing one is created as
        -- missing. A row before one the call may hold already is only tried.
        l_held := array_fill(false, ARRAY[m]);
        FOR r IN 1 .. m LOOP
            CONTINUE WHEN w_req[r] IS NULL;
            a := w_req[r];
            lk := txlimit_lock_row(p_row_name[r], p_row_key[r], p_row_shard[r], p_cap[a], p_anchor_us[a], r < held,
                                   txlimit_create_key(p_row_name[r], p_row_key[r], p_row_shard[r]));
            l_held[r] := lk.got;
            changed := changed OR NOT lk.got OR lk.value IS DISTINCT FROM r_val[r] OR lk.ts IS DISTINCT FROM r_ts[r];
            IF lk.got THEN
                r_val[r] := lk.value; r_ts[r] := lk.ts;
            END IF;
            made := made OR lk.created;
        END LOOP;
        -- On the database's clock, a call that created a row decides, whole, at a clock read once
        -- its locks are held: a row deleted since t (Prune, Reset) was not full at t (spec §1).
        IF p_now_us IS NULL AND made THEN
            t := txlimit_clock(NULL);
        END IF;
        -- 3. Decide on the rows as locked (the plan's answers stand when every row is as read).
        EXIT WHEN NOT changed;
    END LOOP;

    -- 4. Write every row a granted group changed.
    UPDATE txlimit_state s SET value = w.v, ts = w.t
    FROM unnest(p_row_name, p_row_key, p_row_shard, w_req, w_val, w_ts) AS w(nm, ky, sh, rq, v, t)
    WHERE w.rq IS NOT NULL AND s.name = w.nm AND s.key = w.ky AND s.shard = w.sh;

    -- 5. The answers.
    RETURN QUERY SELECT * FROM txlimit_answers(t, p_count, p_allow, p_step_us, p_rate, p_period_us, p_cap,
        p_row_a, p_row_b, p_row_shard, q_w, q_va, q_ta, q_vb, q_tb, q_ch, q_ok, q_now);
END
$$;
-- +goose StatementEnd

-- txlimit_decide_one_v1 decides a list of one request (a Limit, LimitN, Check or CheckN, the most
-- common call), given as scalars, and returns its answer as txlimit_pack_v1's eight numbers. Its
-- candidate shards p_shards: one when unsharded; for a sharded Limit, the two random picks first,
-- then further candidates in random order for steering (txlimit_steer, with p_lock_key the hash of
-- name and key); for a sharded Check, the two picks (under a snapshot, as for a Limit, the first
-- alone when it holds count). A request charging one row is decided by one
-- UPDATE of it (see the top of this file); when that writes nothing, the row is read as the plan,
-- and a refusal (or a Check) is answered from it. Anything else (a missing row, a row changed
-- meanwhile, a charge of both shards) is decided by txlimit_decide_v1. p_tried: the statement
-- DecideOneRow (internal/dbsqlc/queries/engine.sql) ran its UPDATE of the one unsharded row first,
-- which under READ COMMITTED grants what leaves the row at zero or above; that UPDATE may hold the
-- row without having written it, so no other row is waited for out of order here. p_t_us: the
-- reading that statement took (for the UPDATE), to decide at here too, so that a call's clock is
-- read once before any wait (docs/spec.md §2); NULL: read here (txlimit_clock(p_now_us)). The road
-- for lists gets p_now_us, not that reading: on the database's clock (NULL) it decides a row it
-- creates at a reading of its own (see txlimit_decide_v1).
-- +goose StatementBegin
CREATE FUNCTION txlimit_decide_one_v1(
    p_now_us bigint, p_name text, p_key text, p_count double precision, p_allow double precision, p_dry boolean,
    p_step_us bigint, p_rate double precision, p_period_us bigint, p_cap double precision, p_anchor_us bigint,
    p_shards integer[], p_lock_key bigint, p_tried boolean, p_t_us bigint)
RETURNS bytea
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    t bigint := coalesce(p_t_us, txlimit_clock(p_now_us));
    a integer; b integer; -- the candidates, as steering chose them
    sh integer; held integer; pos integer; got boolean; two boolean; ch integer;
    v double precision; vts bigint; -- the row as the UPDATE left it
    va double precision; ta bigint; fa boolean; lv_a double precision; -- the rows as read: the plan
    vb double precision; tb bigint; fb boolean; lv_b double precision;
    ans bytea; lc tid; -- the answer; a row locked
BEGIN
    IF p_shards[2] IS NULL AND NOT p_dry THEN
        -- Under READ COMMITTED, DecideOneRow's UPDATE of the row (p_tried) ran already and did not
        -- write it; it granted nothing below zero, so a request allowed there is tried again
        -- below. Under the other levels it did not run: the UPDATE below does its work, here where
        -- this function's planner settings keep it on the primary key.
        IF NOT p_tried OR p_allow > 0 OR current_setting('transaction_isolation') <> 'read committed' THEN
            sh := p_shards[1];
        END IF;
    ELSIF p_shards[2] IS NOT NULL AND NOT p_dry THEN
        two := current_setting('transaction_isolation') = 'read committed';
        pos := txlimit_steer(p_name, p_key, p_shards, p_lock_key, NOT two);
        IF pos = 0 THEN
            RETURN txlimit_pack_v1(false, false, true, 0, p_shards[1], p_shards[2], 0, 0, t, 0);
        END IF;
        a := p_shards[abs(pos)]; b := p_shards[abs(pos) % cardinality(p_shards) + 1];
        LOOP -- The plan: a read, and b too unless, under a snapshot, a alone holds count (a row
             -- read but not charged makes this transaction a reader of whoever charges it).
            SELECT s.value, s.ts INTO va, ta FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard = a;
            fa := FOUND; va := coalesce(va, p_cap); ta := coalesce(ta, p_anchor_us);
            lv_a := txlimit_level(va, ta, t, p_rate, p_period_us, p_step_us, p_cap);
            two := two OR lv_a < p_count;
            lv_b := 0;
            IF two THEN
                SELECT s.value, s.ts INTO vb, tb FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard = b;
                fb := FOUND; vb := coalesce(vb, p_cap); tb := coalesce(tb, p_anchor_us);
                lv_b := txlimit_level(vb, tb, t, p_rate, p_period_us, p_step_us, p_cap);
            END IF;
            ch := txlimit_charge(lv_a, lv_b, two, p_count, 0);
            IF NOT txlimit_granted(ch, txlimit_left(0, ch, lv_a, lv_b, p_count), txlimit_left(1, ch, lv_a, lv_b, p_count),
                                   p_allow) THEN
                RETURN txlimit_pack_v1(false, false, false, lv_a + lv_b, a, b, ch, txlimit_retry_at(p_rate, p_period_us,
                                       p_step_us, p_cap, p_count, p_allow, two, va, ta, vb, tb, t), t, 0);
            END IF;
            -- Every candidate taken (txlimit_steer): granted, so wait for a's holder and plan again.
            EXIT WHEN pos > 0 OR pg_current_xact_id_if_assigned() IS NOT NULL;
            pos := 1;
            PERFORM txlimit_await_shard(p_lock_key, a);
        END LOOP;
        -- A charge of one existing shard: locked without waiting, and when another transaction
        -- holds it, the other pick instead if that alone holds count; only when both are held,
        -- waited for as an UPDATE does. A row locked but not written (the rule refuses its latest
        -- version) is left to the road for lists.
        IF ch = 1 AND fa OR ch = 2 AND fb THEN
            sh := CASE WHEN ch = 1 THEN a ELSE b END;
            FOR j IN 1 .. CASE WHEN (CASE WHEN ch = 1 THEN lv_b >= p_count AND fb ELSE lv_a >= p_count AND fa END)
                               THEN 2 ELSE 1 END LOOP
                SELECT l.ctid INTO lc FROM txlimit_state l
                WHERE l.name = p_name AND l.key = p_key AND l.shard = sh FOR UPDATE SKIP LOCKED;
                got := FOUND;
                IF got THEN -- locked: written if still as the plan read it (else decided again below)
                    UPDATE txlimit_state s
                    SET value = txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, p_rate, p_period_us, p_step_us, p_cap),
                                             0, p_count),
                        ts = txlimit_next_ts(s.ts, t, p_step_us)
                    WHERE s.ctid = lc AND s.name = p_name AND s.key = p_key AND s.shard = sh -- a ctid alone
                      -- names a row only within one table: a partitioned txlimit_state repeats it
                      AND s.value = CASE WHEN sh = a THEN va ELSE vb END AND s.ts = CASE WHEN sh = a THEN ta ELSE tb END
                      AND txlimit_granted(1, txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, p_rate, p_period_us,
                                                                              p_step_us, p_cap), 0, p_count), 0, p_allow)
                    RETURNING s.value, s.ts INTO v, vts;
                END IF;
                EXIT WHEN got;
                sh := CASE WHEN sh = a THEN b ELSE a END; -- held by another transaction: the other pick
            END LOOP;
            IF NOT got THEN -- both held
                sh := CASE WHEN ch = 1 THEN a ELSE b END;
            END IF;
        END IF;
    END IF;
    -- The one row to charge, waiting for it when another transaction holds it: the UPDATE writes it
    -- where the rule grants the request on its latest version (see the top of this file); a
    -- shard only if still as the plan read it (else its charge is decided again, below).
    IF sh IS NOT NULL AND got IS NOT TRUE THEN
        UPDATE txlimit_state s
        SET value = txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, p_rate, p_period_us, p_step_us, p_cap), 0, p_count),
            ts = txlimit_next_ts(s.ts, t, p_step_us)
        WHERE s.name = p_name AND s.key = p_key AND s.shard = sh
          AND (b IS NULL OR (s.value = CASE WHEN sh = a THEN va ELSE vb END AND s.ts = CASE WHEN sh = a THEN ta ELSE tb END))
          AND txlimit_granted(1, txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, p_rate, p_period_us, p_step_us,
                                                                  p_cap), 0, p_count), 0, p_allow)
        RETURNING s.value, s.ts INTO v, vts;
    END IF;
    IF v IS NULL AND b IS NOT NULL AND sh IS NOT NULL THEN
        -- A shard locked (or waited for) and not written: the rule refused its latest version, and
        -- this transaction may hold it, so no row before it is waited for.
        held := CASE WHEN sh = greatest(a, b) THEN 2 ELSE 1 END;
    END IF;
    IF v IS NOT NULL THEN
        RETURN txlimit_written_v1(v, vts, t, sh, CASE WHEN b IS NULL THEN -1 WHEN sh = a THEN b ELSE a END,
                                  CASE WHEN b IS NULL THEN 0 WHEN sh = a THEN lv_b ELSE lv_a END,
                                  txlimit_debt_until(v, vts, t, p_rate, p_period_us, p_step_us, p_cap));
    END IF;
    IF p_shards[2] IS NULL OR p_dry AND current_setting('transaction_isolation') <> 'read committed' THEN
        a := p_shards[1];
        -- Not written (always, for a Check): the plan, on the row as read now. A refusal or a
        -- Check is answered from it; a missing row, or one that grants now, goes to the road for
        -- lists. A sharded Check under a snapshot answers what the Limit would: its first pick
        -- alone when that holds count (the second not read), else both, by the road for lists.
        SELECT s.value, s.ts INTO va, ta FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard = a;
        fa := FOUND; va := coalesce(va, p_cap); ta := coalesce(ta, p_anchor_us); -- a missing row is full
        lv_a := txlimit_level(va, ta, t, p_rate, p_period_us, p_step_us, p_cap);
        v := txlimit_left(0, 1, lv_a, 0, p_count);
        IF p_shards[2] IS NULL AND NOT txlimit_granted(1, v, 0, p_allow) THEN
            RETURN txlimit_pack_v1(false, false, false, lv_a, a, -1, 1, txlimit_retry_at(p_rate, p_period_us, p_step_us,
                                   p_cap, p_count, p_allow, false, va, ta, NULL, NULL, t), t, 0);
        ELSIF p_dry AND (p_shards[2] IS NULL OR lv_a >= p_count) THEN -- a Check answers what the write would
            vts := txlimit_next_ts(ta, t, p_step_us);
            RETURN txlimit_written_v1(v, vts, t, a, coalesce(p_shards[2], -1), 0,
                                      txlimit_debt_until(v, vts, t, p_rate, p_period_us, p_step_us, p_cap));
        END IF;
        held := CASE WHEN fa AND NOT p_dry THEN 1 ELSE 0 END;
    END IF;
    -- A missing row, a row changed meanwhile, a charge of both shards, a sharded Check: the road
    -- for lists.
    IF b IS NULL AND p_shards[2] IS NOT NULL THEN -- a sharded Check: its two picks
        a := p_shards[1]; b := p_shards[2];
    ELSIF NOT two THEN -- under a snapshot, a alone serves and b was not read: a alone
        b := NULL; held := least(held, 1);
    END IF;
    SELECT d.answer INTO ans -- p_now_us, not t: on the database's clock (NULL), see txlimit_decide_v1
    FROM txlimit_decide_v1(p_now_us, '{0}', ARRAY[p_count], ARRAY[p_allow], ARRAY[p_dry], '{f}', ARRAY[p_step_us],
                           ARRAY[p_rate], ARRAY[p_period_us], ARRAY[p_cap], ARRAY[p_anchor_us],
                           ARRAY[CASE WHEN b IS NULL OR a < b THEN 1 ELSE 2 END],
                           ARRAY[CASE WHEN b IS NULL THEN 0 WHEN a < b THEN 2 ELSE 1 END],
                           CASE WHEN b IS NULL THEN ARRAY[p_name] ELSE ARRAY[p_name, p_name] END,
                           CASE WHEN b IS NULL THEN ARRAY[p_key] ELSE ARRAY[p_key, p_key] END,
                           CASE WHEN b IS NULL THEN ARRAY[a] ELSE ARRAY[least(a, b), greatest(a, b)] END,
                           coalesce(held, 0)) d;
    RETURN ans;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION IF EXISTS txlimit_decide_one_v1(bigint, text, text, double precision, double precision, boolean, bigint,
                                              double precision, bigint, double precision, bigint, integer[], bigint, boolean,
                                              bigint);
DROP FUNCTION IF EXISTS txlimit_decide_v1(bigint, integer[], double precision[], double precision[], boolean[], boolean[], bigint[],
                                          double precision[], bigint[], double precision[], bigint[], integer[], integer[], text[],
                                          text[], integer[], integer);
DROP FUNCTION IF EXISTS txlimit_answers(bigint, double precision[], double precision[], bigint[], double precision[], bigint[],
                                        double precision[], integer[], integer[], integer[], boolean[], double precision[], bigint[],
                                        double precision[], bigint[], integer[], boolean[], boolean[]);
DROP TYPE IF EXISTS txlimit_answer_v1;
DROP FUNCTION IF EXISTS txlimit_alone(bigint, boolean[], integer[], double precision[], double precision[], bigint[],
                                      double precision[], bigint[], double precision[], text[], text[], integer[]);
DROP FUNCTION IF EXISTS txlimit_lock_row(text, text, integer, double precision, bigint, boolean, bigint);
DROP FUNCTION IF EXISTS txlimit_create_key(text, text, integer);
DROP FUNCTION IF EXISTS txlimit_await_shard(bigint, integer);
DROP FUNCTION IF EXISTS txlimit_steer(text, text, integer[], bigint, boolean);
DROP FUNCTION IF EXISTS txlimit_written_v1(double precision, bigint, bigint, integer, integer, double precision, bigint);
DROP FUNCTION IF EXISTS txlimit_pack_v1(boolean, boolean, boolean, double precision, integer, integer, integer, bigint, bigint,
                                        bigint);
DROP FUNCTION IF EXISTS txlimit_stale(bigint, bigint, pg_snapshot);
