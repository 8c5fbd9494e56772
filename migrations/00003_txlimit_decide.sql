-- +goose Up

-- The decision. Every call of the library is one call of txlimit_decide_one_v1 (a list of one
-- request, given as scalars) or txlimit_decide_v1 (a list, given as parallel arrays). Both take the
-- one road: plan on lock-free reads, lock the rows in the global order (name, key, shard, as
-- bytes), decide on what is locked, write. Where a request is alone on one row, the lock, the
-- decision and the write are one UPDATE of that row whose condition is the grant rule: its scan
-- reads the row as the plan does, and when another transaction changed the row meanwhile Postgres
-- locks the latest version and evaluates the rule again on it, so that the request is decided on
-- the row it holds. A request that UPDATE does not write (refused, or its row missing) goes on
-- through the steps below. Entry points carry a version in their name (see CONTRIBUTING.md).
-- Every row access is a primary-key probe (sequential scans are off for these functions), so under
-- SERIALIZABLE a decision holds tuple or page predicate locks only.

-- txlimit_stale: whether a row whose xmax is xm (a 32-bit transaction ID; 0 or NULL: none) was
-- written or locked by a transaction that the snapshot snap cannot see, in progress or committed
-- after snap was taken (xr: snap's xmax as a number, next to which xm is widened to 64 bits).
-- Under REPEATABLE READ or SERIALIZABLE, locking such a row could only fail, so steering passes
-- over it.
-- +goose StatementBegin
CREATE FUNCTION txlimit_stale(xm bigint, xr bigint, snap pg_snapshot)
RETURNS boolean LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(xm, 0) <> 0 AND x.x8 >= 3
           AND NOT pg_visible_in_snapshot(x.x8::text::xid8, snap)
           AND (x.x8 >= xr OR pg_xact_status(x.x8::text::xid8) IS DISTINCT FROM 'aborted')
    FROM (SELECT xr + ((xm - (xr & 4294967295)) % 4294967296 + 4294967296 + 2147483648) % 4294967296
                 - 2147483648 AS x8) x
$$;
-- +goose StatementEnd

-- txlimit_pick: the plan of a lone request on a sharded limit: which of its candidate shards it
-- charges. Concurrent callers of one key are steered apart before they read a row: a is the first
-- candidate whose transaction-scoped advisory lock (p_lock_key XOR the table's OID shifted left 20
-- bits XOR the shard: only ever tried, held until the transaction ends) this transaction gets and,
-- under REPEATABLE READ or SERIALIZABLE, whose row is not stale (locking it from this snapshot
-- could only fail); b is the candidate after a. When every candidate is taken, READ COMMITTED goes
-- on with the first (and may wait for its row) and a snapshot isolation level returns busy, having
-- read and written nothing. Then a is read, and b too unless, under a snapshot, a alone holds count
-- (a row read but not charged makes this transaction a reader of whoever charges it). Returns the
-- shards, the charge the plan chooses (txlimit_charge), whether the plan grants it, the levels of
-- a and b as read (lv_b 0 when only a was read) and whether their rows exist.
-- +goose StatementBegin
CREATE FUNCTION txlimit_pick(p_name text, p_key text, p_shards integer[], p_lock_key bigint, t bigint,
                             p_count double precision, p_allow double precision, p_step_us bigint,
                             p_rate double precision, p_period_us bigint, p_cap double precision, p_anchor_us bigint,
                             OUT busy boolean, OUT shard_a integer, OUT shard_b integer, OUT charge integer,
                             OUT granted boolean, OUT lv_a double precision, OUT lv_b double precision,
                             OUT a_found boolean, OUT b_found boolean)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    snapshot boolean := current_setting('transaction_isolation') <> 'read committed';
    snap pg_snapshot; xr bigint; pos integer; n integer := cardinality(p_shards);
    va double precision; ta bigint; vb double precision; tb bigint; xm bigint; two boolean;
    lock_key bigint := p_lock_key # ('txlimit_state'::regclass::oid::bigint << 20);
BEGIN
    busy := false; lv_b := 0;
    IF snapshot THEN
        snap := pg_current_snapshot();
        xr := pg_snapshot_xmax(snap)::text::bigint;
    END IF;
    FOR j IN 1 .. n LOOP
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(lock_key # p_shards[j]::bigint);
        IF snapshot THEN
            SELECT s.value, s.ts, s.xmax::text::bigint INTO va, ta, xm
            FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard = p_shards[j];
            a_found := FOUND;
            CONTINUE WHEN txlimit_stale(xm, xr, snap);
        END IF;
        pos := j;
        EXIT;
    END LOOP;
    IF pos IS NULL AND snapshot THEN
        busy := true; shard_a := p_shards[1]; shard_b := p_shards[2];
        RETURN;
    END IF;
    pos := coalesce(pos, 1);
    shard_a := p_shards[pos]; shard_b := p_shards[pos % n + 1];
    IF NOT snapshot THEN -- (under a snapshot, a was read while steering)
        SELECT s.value, s.ts INTO va, ta
        FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard = shard_a;
        a_found := FOUND;
    END IF;
    lv_a := txlimit_level(coalesce(va, p_cap), coalesce(ta, p_anchor_us), t, p_rate, p_period_us, p_step_us, p_cap);
    two := NOT snapshot OR lv_a < p_count;
    IF two THEN
        SELECT s.value, s.ts INTO vb, tb
        FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard = shard_b;
        b_found := FOUND;
        lv_b := txlimit_level(coalesce(vb, p_cap), coalesce(tb, p_anchor_us), t, p_rate, p_period_us, p_step_us, p_cap);
    END IF;
    charge := txlimit_charge(lv_a, lv_b, two, p_count, 0);
    granted := txlimit_granted(charge, txlimit_left(0, charge, lv_a, lv_b, p_count),
                               txlimit_left(1, charge, lv_a, lv_b, p_count), p_allow);
END
$$;
-- +goose StatementEnd

-- txlimit_fold: decides a list of requests in list order on the rows given (step 1, the plan, on
-- the rows as read; step 3, the decision, on the rows as locked), each all-or-nothing group seeing
-- the effect of the groups granted before it. Requests: p_grp (groups numbered in list order, a
-- group's requests consecutive), count, allow (how far below zero a charged row may go), dry
-- (Check: changes nothing), skip (decided already), the config per shard, and the candidate rows
-- row_a and row_b (0: unsharded). Rows: found, value, ts; a missing row is full, at its anchor.
-- In the decision, held names the rows this call holds, and plan_ch the charge of each request
-- whose group the plan granted: such a request keeps to the rows it holds, and one the rules grant
-- on a row it does not hold is refused, to retry at once (retry_now): an under-grant, never an
-- over-grant. Out, per request: the rows as evaluated (va, ta, vb, tb), their levels, the charge,
-- whether the rules grant it (ok) and whether its group is granted (gok); per row, w_mod and the
-- value and ts the granted groups leave it with (in the plan: the rows to lock).
-- +goose StatementBegin
CREATE FUNCTION txlimit_fold(t bigint, p_grp integer[], p_count double precision[], p_allow double precision[],
                             p_dry boolean[], p_skip boolean[], p_step_us bigint[], p_rate double precision[],
                             p_period_us bigint[], p_cap double precision[], p_anchor_us bigint[],
                             p_row_a integer[], p_row_b integer[],
                             r_found boolean[], r_val double precision[], r_ts bigint[],
                             r_held boolean[], p_plan_ch integer[],
                             OUT q_va double precision[], OUT q_ta bigint[], OUT q_vb double precision[], OUT q_tb bigint[],
                             OUT q_lva double precision[], OUT q_lvb double precision[], OUT q_ch integer[],
                             OUT q_ok boolean[], OUT q_gok boolean[], OUT q_retry_now boolean[],
                             OUT w_mod boolean[], OUT w_val double precision[], OUT w_ts bigint[])
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    n integer := cardinality(p_grp);
    g integer := 1; e integer; i integer; a integer; b integer; fixed integer; g_ok boolean;
BEGIN
    q_va := array_fill(NULL::double precision, ARRAY[n]); q_vb := q_va; q_lva := q_va; q_lvb := q_va;
    q_ta := array_fill(NULL::bigint, ARRAY[n]); q_tb := q_ta; q_ch := array_fill(NULL::integer, ARRAY[n]);
    q_ok := array_fill(NULL::boolean, ARRAY[n]); q_gok := q_ok; q_retry_now := q_ok;
    w_mod := array_fill(false, ARRAY[cardinality(r_found)]); w_val := r_val; w_ts := r_ts;
    WHILE g <= n LOOP
        e := g; -- the group: requests g .. e
        WHILE e < n AND p_grp[e + 1] = p_grp[g] LOOP
            e := e + 1;
        END LOOP;
        g_ok := true;
        FOR i IN g .. e LOOP
            CONTINUE WHEN p_skip[i];
            a := p_row_a[i]; b := p_row_b[i];
            -- Each row as the groups granted so far leave it, as given, or missing.
            q_va[i] := CASE WHEN w_mod[a] OR r_found[a] THEN w_val[a] ELSE p_cap[i] END;
            q_ta[i] := CASE WHEN w_mod[a] OR r_found[a] THEN w_ts[a] ELSE p_anchor_us[i] END;
            q_lva[i] := txlimit_level(q_va[i], q_ta[i], t, p_rate[i], p_period_us[i], p_step_us[i], p_cap[i]);
            q_lvb[i] := 0;
            IF b > 0 THEN
                q_vb[i] := CASE WHEN w_mod[b] OR r_found[b] THEN w_val[b] ELSE p_cap[i] END;
                q_tb[i] := CASE WHEN w_mod[b] OR r_found[b] THEN w_ts[b] ELSE p_anchor_us[i] END;
                q_lvb[i] := txlimit_level(q_vb[i], q_tb[i], t, p_rate[i], p_period_us[i], p_step_us[i], p_cap[i]);
            END IF;
            fixed := 0;
            IF r_held IS NOT NULL AND p_plan_ch[i] > 0 THEN
                fixed := CASE WHEN r_held[a] THEN 1 ELSE 0 END + CASE WHEN b > 0 AND r_held[b] THEN 2 ELSE 0 END;
            END IF;
            q_ch[i] := txlimit_charge(q_lva[i], q_lvb[i], b > 0, p_count[i], fixed);
            q_ok[i] := txlimit_granted(q_ch[i], txlimit_left(0, q_ch[i], q_lva[i], q_lvb[i], p_count[i]),
                                       txlimit_left(1, q_ch[i], q_lva[i], q_lvb[i], p_count[i]), p_allow[i]);
            g_ok := g_ok AND q_ok[i];
        END LOOP;
        FOR i IN g .. e LOOP
            CONTINUE WHEN p_skip[i];
            -- Granted by the rules on a row this call does not hold: refused, to retry at once.
            q_retry_now[i] := g_ok AND r_held IS NOT NULL AND NOT p_dry[i]
                              AND ((q_ch[i] <> 2 AND NOT r_held[p_row_a[i]]) OR (q_ch[i] <> 1 AND NOT r_held[p_row_b[i]]));
        END LOOP;
        g_ok := g_ok AND NOT q_retry_now[g:e] @> '{true}';
        FOR i IN g .. e LOOP
            CONTINUE WHEN p_skip[i];
            q_gok[i] := g_ok;
            CONTINUE WHEN NOT g_ok OR p_dry[i];
            -- A granted group: its rows as it leaves them, seen by the groups after it.
            a := p_row_a[i]; b := p_row_b[i];
            IF q_ch[i] <> 2 THEN
                w_val[a] := txlimit_left(0, q_ch[i], q_lva[i], q_lvb[i], p_count[i]);
                w_ts[a] := txlimit_next_ts(q_ta[i], t, p_step_us[i]); w_mod[a] := true;
            END IF;
            IF q_ch[i] <> 1 THEN
                w_val[b] := txlimit_left(1, q_ch[i], q_lva[i], q_lvb[i], p_count[i]);
                w_ts[b] := txlimit_next_ts(q_tb[i], t, p_step_us[i]); w_mod[b] := true;
            END IF;
        END LOOP;
        g := e + 1;
    END LOOP;
END
$$;
-- +goose StatementEnd

-- txlimit_lock_row: step 2 for one row: lock it (FOR UPDATE, which re-reads its latest version),
-- or, when it is missing, create it stamped as missing (full at its anchor: p_value, p_ts) and so
-- hold it. With p_try, nothing is waited for (a row that sorts before one this call already holds,
-- so that no lock is awaited out of the global order): got is false when another transaction holds
-- or is creating the row. Only one transaction at a time creates a row (p_create_key, a
-- transaction-scoped advisory lock: a hash of the row and the table's OID, so that schemas do not
-- share them), so that an insert never waits for another transaction's.
-- +goose StatementBegin
CREATE FUNCTION txlimit_lock_row(p_name text, p_key text, p_shard integer, p_value double precision, p_ts bigint,
                                 p_try boolean, p_create_key bigint,
                                 OUT got boolean, OUT value double precision, OUT ts bigint)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    k integer;
BEGIN
    got := false;
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
            got := true; value := p_value; ts := p_ts; RETURN;
        END IF;
        -- Created and committed meanwhile by another transaction: lock it.
    END LOOP;
    RAISE EXCEPTION 'txlimit: row (%, %, %) keeps appearing and vanishing', p_name, p_key, p_shard
        USING ERRCODE = '40001';
END
$$;
-- +goose StatementEnd

-- txlimit_results: step 5, one output row per request of a list (see txlimit_decide_v1): from
-- the row as the fast UPDATE left it (skip), or from the decision's fold. A run of identical
-- refusals (a flood on one key) searches its RetryAt once.
-- +goose StatementBegin
CREATE FUNCTION txlimit_results(t bigint, p_count double precision[], p_allow double precision[], p_step_us bigint[],
                                p_rate double precision[], p_period_us bigint[], p_cap double precision[],
                                p_row_a integer[], p_row_b integer[], p_row_shard integer[],
                                skip boolean[], o_val double precision[], o_ts bigint[],
                                q_va double precision[], q_ta bigint[], q_vb double precision[], q_tb bigint[],
                                q_lva double precision[], q_lvb double precision[], q_ch integer[], q_ok boolean[],
                                q_retry_now boolean[])
RETURNS TABLE (ok boolean, reserved boolean, busy boolean, level_sum double precision, shard_a integer,
               shard_b integer, charged integer, retry_at_us bigint, now_us bigint, ts_us bigint)
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    two boolean; ch integer; end_a double precision; end_b double precision;
    key record; memo_key record; memo_at bigint; memo boolean := false;
BEGIN
    busy := false; now_us := t;
    FOR i IN 1 .. cardinality(p_count) LOOP
        two := p_row_b[i] > 0;
        shard_a := p_row_shard[p_row_a[i]]; shard_b := CASE WHEN two THEN p_row_shard[p_row_b[i]] ELSE -1 END;
        retry_at_us := 0; ts_us := 0;
        IF skip[i] THEN -- written by the fast UPDATE
            ok := o_val[i] >= 0; reserved := NOT ok; level_sum := o_val[i]; charged := 1; ts_us := o_ts[i];
            IF reserved THEN
                retry_at_us := txlimit_retry_at(p_rate[i], p_period_us[i], p_step_us[i], p_cap[i], 0, 0, false,
                                                o_val[i], o_ts[i], NULL, NULL, t);
            END IF;
            RETURN NEXT;
            CONTINUE;
        END IF;
        ch := q_ch[i]; charged := ch;
        end_a := txlimit_left(0, ch, q_lva[i], q_lvb[i], p_count[i]);
        end_b := txlimit_left(1, ch, q_lva[i], q_lvb[i], p_count[i]);
        IF q_ok[i] AND NOT q_retry_now[i] THEN
            ok := txlimit_granted(ch, end_a, end_b, 0); reserved := NOT ok;
            level_sum := end_a + CASE WHEN two THEN end_b ELSE 0 END;
            IF ch = 1 THEN
                ts_us := txlimit_next_ts(q_ta[i], t, p_step_us[i]);
            ELSIF ch = 2 THEN
                ts_us := txlimit_next_ts(q_tb[i], t, p_step_us[i]);
            END IF;
            IF reserved THEN -- when every charged row is out of debt
                IF ch <> 2 THEN
                    retry_at_us := txlimit_retry_at(p_rate[i], p_period_us[i], p_step_us[i], p_cap[i], 0, 0, false,
                                                    end_a, txlimit_next_ts(q_ta[i], t, p_step_us[i]), NULL, NULL, t);
                END IF;
                IF ch <> 1 THEN
                    retry_at_us := greatest(retry_at_us,
                        txlimit_retry_at(p_rate[i], p_period_us[i], p_step_us[i], p_cap[i], 0, 0, false,
                                         end_b, txlimit_next_ts(q_tb[i], t, p_step_us[i]), NULL, NULL, t));
                END IF;
            END IF;
        ELSE
            ok := false; reserved := false; level_sum := q_lva[i] + q_lvb[i];
            IF q_retry_now[i] THEN
                retry_at_us := t; -- granted by the rules on a row another transaction holds: retry at once
            ELSE
                key := ROW(p_rate[i], p_period_us[i], p_step_us[i], p_cap[i], p_count[i], p_allow[i], two,
                           q_va[i], q_ta[i], q_vb[i], q_tb[i]);
                IF memo AND memo_key IS NOT DISTINCT FROM key THEN
                    retry_at_us := memo_at;
                ELSE
                    retry_at_us := txlimit_retry_at(p_rate[i], p_period_us[i], p_step_us[i], p_cap[i], p_count[i],
                                                    p_allow[i], two, q_va[i], q_ta[i], q_vb[i], q_tb[i], t);
                    memo := true; memo_key := key; memo_at := retry_at_us;
                END IF;
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
-- +goose StatementEnd

-- txlimit_decide_v1 decides a list of requests (a Batcher's batch, a LimitMany, a list of one that
-- the scalar entry point could not finish) and returns one row per request, in list order. The
-- caller (ratelimit/engine.go) numbers the rows the list may touch in the global lock order and
-- gives each request its candidate rows, row_a and row_b (0 when unsharded). A request marked fast
-- is a group of one request alone on its row: those are first decided by one UPDATE, in row order
-- (see the top of this file). p_held: the last row (in that order) the call may hold already.
-- Output: ok (granted now), reserved (granted below zero), busy (always false here), level_sum
-- (tokens in the rows looked at: after the charge when granted, before it when not), shard_a,
-- shard_b (-1 when unsharded), charged (1: a, 2: b, 3: both), retry_at_us (0 when granted now: for
-- a reservation when its debt is paid, for a refusal when the same request is granted; see
-- txlimit_retry_at), now_us (the clock reading), ts_us (a reservation on one row: the ts it left).
-- +goose StatementBegin
CREATE FUNCTION txlimit_decide_v1(
    p_now_us bigint, p_grp integer[], p_count double precision[], p_allow double precision[], p_dry boolean[],
    p_fast boolean[], p_step_us bigint[], p_rate double precision[], p_period_us bigint[], p_cap double precision[],
    p_anchor_us bigint[], p_row_a integer[], p_row_b integer[],
    p_row_name text[], p_row_key text[], p_row_shard integer[], p_held integer)
RETURNS TABLE (ok boolean, reserved boolean, busy boolean, level_sum double precision, shard_a integer,
               shard_b integer, charged integer, retry_at_us bigint, now_us bigint, ts_us bigint)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    t bigint := txlimit_clock(p_now_us);
    n integer := cardinality(p_grp); m integer := cardinality(p_row_name);
    skip boolean[] := array_fill(false, ARRAY[n]);
    o_val double precision[] := array_fill(NULL::double precision, ARRAY[n]); o_ts bigint[] := o_val;
    held integer := p_held; rec record; r integer; i integer; plan_ch integer[];
    rd record; -- the rows as read: found, val, ts
    lk record; l_found boolean[]; l_val double precision[]; l_ts bigint[]; l_held boolean[]; changed boolean := false;
    f record;  -- a fold's answers
BEGIN
    -- The fast requests: one UPDATE, in row order, writes each row whose latest version the rule
    -- grants its request on.
    IF p_fast && '{true}'::boolean[] THEN
        FOR rec IN
            UPDATE txlimit_state s
            SET value = txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, u.rate, u.per, u.step, u.cap), 0, u.cnt),
                ts = txlimit_next_ts(s.ts, t, u.step)
            FROM (SELECT * FROM unnest(p_fast, p_row_a, p_count, p_allow, p_step_us, p_rate, p_period_us, p_cap)
                                WITH ORDINALITY AS v(fast, r, cnt, alw, step, rate, per, cap, i)
                  WHERE v.fast ORDER BY v.r OFFSET 0) u
            WHERE s.name = p_row_name[u.r] AND s.key = p_row_key[u.r] AND s.shard = p_row_shard[u.r]
              AND txlimit_granted(1, txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, u.rate, u.per, u.step, u.cap),
                                                  0, u.cnt), 0, u.alw)
            RETURNING u.i::integer AS i, s.value AS v, s.ts AS ts
        LOOP
            skip[rec.i] := true; o_val[rec.i] := rec.v; o_ts[rec.i] := rec.ts;
        END LOOP;
        SELECT greatest(held, max(v.r)) INTO held
        FROM unnest(p_fast, p_row_a) AS v(fast, r) WHERE v.fast;
    END IF;
    IF NOT skip @> '{false}'::boolean[] THEN
        RETURN QUERY SELECT * FROM txlimit_results(t, p_count, p_allow, p_step_us, p_rate, p_period_us, p_cap,
                                                    p_row_a, p_row_b, p_row_shard, skip, o_val, o_ts,
                                                    NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
        RETURN;
    END IF;

    -- 1. Plan: every row read without a lock, then the list folded on them.
    SELECT array_agg(q.found ORDER BY q.i) AS found, array_agg(q.v ORDER BY q.i) AS val, array_agg(q.ts ORDER BY q.i) AS ts
    INTO rd
    FROM (SELECT u.i, s.value IS NOT NULL AS found, s.value AS v, s.ts
          FROM unnest(p_row_name, p_row_key, p_row_shard) WITH ORDINALITY AS u(nm, ky, sh, i)
          LEFT JOIN LATERAL (SELECT s.value, s.ts FROM txlimit_state s
                             WHERE s.name = u.nm AND s.key = u.ky AND s.shard = u.sh OFFSET 0) s ON true) q;
    f := txlimit_fold(t, p_grp, p_count, p_allow, p_dry, skip, p_step_us, p_rate, p_period_us, p_cap, p_anchor_us,
                      p_row_a, p_row_b, rd.found, rd.val, rd.ts, NULL, NULL);

    -- 2. Lock, in row order, the rows the granted groups charge; a missing one is created as
    -- missing. A row before one the call may hold already is only tried.
    l_found := rd.found; l_val := rd.val; l_ts := rd.ts; l_held := array_fill(false, ARRAY[m]);
    FOR r IN 1 .. m LOOP
        CONTINUE WHEN NOT f.w_mod[r];
        i := array_position(p_row_a, r);
        IF i IS NULL THEN
            i := array_position(p_row_b, r);
        END IF;
        lk := txlimit_lock_row(p_row_name[r], p_row_key[r], p_row_shard[r], p_cap[i], p_anchor_us[i], r < held,
                               hashtextextended(p_row_key[r], hashtext(p_row_name[r])) # p_row_shard[r]
                               # ('txlimit_state'::regclass::oid::bigint << 20));
        l_held[r] := lk.got;
        IF lk.got THEN
            changed := changed OR NOT rd.found[r] OR lk.value IS DISTINCT FROM rd.val[r] OR lk.ts IS DISTINCT FROM rd.ts[r];
            l_found[r] := true; l_val[r] := lk.value; l_ts[r] := lk.ts;
        ELSE
            changed := true;
        END IF;
    END LOOP;

    -- 3. Decide on the rows as locked (the plan's answers stand when every row is as read).
    IF changed THEN
        SELECT array_agg(CASE WHEN x.g AND NOT x.d THEN x.c ELSE 0 END ORDER BY x.i) INTO plan_ch
        FROM unnest(f.q_gok, p_dry, f.q_ch) WITH ORDINALITY AS x(g, d, c, i);
        f := txlimit_fold(t, p_grp, p_count, p_allow, p_dry, skip, p_step_us, p_rate, p_period_us, p_cap, p_anchor_us,
                          p_row_a, p_row_b, l_found, l_val, l_ts, l_held, plan_ch);
    END IF;

    -- 4. Write every row a granted group changed.
    UPDATE txlimit_state s SET value = w.v, ts = w.t
    FROM unnest(p_row_name, p_row_key, p_row_shard, f.w_mod, f.w_val, f.w_ts) AS w(nm, ky, sh, md, v, t)
    WHERE w.md AND s.name = w.nm AND s.key = w.ky AND s.shard = w.sh;

    RETURN QUERY SELECT * FROM txlimit_results(t, p_count, p_allow, p_step_us, p_rate, p_period_us, p_cap,
                                                p_row_a, p_row_b, p_row_shard, skip, o_val, o_ts,
                                                f.q_va, f.q_ta, f.q_vb, f.q_tb, f.q_lva, f.q_lvb, f.q_ch, f.q_ok, f.q_retry_now);
END
$$;
-- +goose StatementEnd

-- txlimit_decide_one_v1 decides a list of one request (a Limit, LimitN, Check or CheckN, the most
-- common call), given as scalars: its candidate shards p_shards (one when unsharded; for a sharded
-- Limit, the two random picks first, then, for steering under a snapshot, further candidates in
-- random order; see txlimit_pick), p_lock_key the advisory-lock key of its shard 0. A request
-- that charges one row is decided by one UPDATE of it (see the top of this file); any other, or
-- one that UPDATE does not write, by txlimit_decide_v1. Output as txlimit_decide_v1's; busy: under
-- a snapshot, every candidate shard was taken (nothing read or written).
-- +goose StatementBegin
CREATE FUNCTION txlimit_decide_one_v1(
    p_now_us bigint, p_name text, p_key text, p_count double precision, p_allow double precision, p_dry boolean,
    p_step_us bigint, p_rate double precision, p_period_us bigint, p_cap double precision, p_anchor_us bigint,
    p_shards integer[], p_lock_key bigint)
RETURNS TABLE (ok boolean, reserved boolean, busy boolean, level_sum double precision, shard_a integer,
               shard_b integer, charged integer, retry_at_us bigint, now_us bigint, ts_us bigint)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    t bigint := txlimit_clock(p_now_us);
    sharded boolean := cardinality(p_shards) > 1;
    pair integer[] := p_shards[1:2]; -- the candidates a and b, as steering chose them
    sh integer; -- the one shard to charge
    pk record; tries integer := 1; held integer := 0; got boolean := false;
    v double precision; vts bigint; other double precision := 0;
BEGIN
    IF NOT p_dry AND NOT sharded THEN
        -- The UPDATE waits for a row another transaction holds.
        sh := p_shards[1]; held := 1;
        UPDATE txlimit_state s
        SET value = txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, p_rate, p_period_us, p_step_us, p_cap), 0, p_count),
            ts = txlimit_next_ts(s.ts, t, p_step_us)
        WHERE s.name = p_name AND s.key = p_key AND s.shard = sh
          AND txlimit_granted(1, txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, p_rate, p_period_us, p_step_us, p_cap),
                                              0, p_count), 0, p_allow)
        RETURNING s.value, s.ts INTO v, vts;
    ELSIF NOT p_dry THEN
        pk := txlimit_pick(p_name, p_key, p_shards, p_lock_key, t, p_count, p_allow, p_step_us, p_rate, p_period_us,
                           p_cap, p_anchor_us);
        IF pk.busy THEN
            RETURN QUERY SELECT false, false, true, 0::double precision, pk.shard_a, pk.shard_b, 0, 0::bigint, t, 0::bigint;
            RETURN;
        END IF;
        pair := ARRAY[pk.shard_a, pk.shard_b];
        -- A charge of one existing shard: it is locked without waiting, and when another
        -- transaction holds it, the other pick is tried instead if it alone holds count. A row
        -- changed since this statement's snapshot is not written here, nor one the rule refuses
        -- once locked (both are then held): the road for lists decides those, and missing rows.
        IF pk.granted AND pk.charge <> 3 AND (CASE WHEN pk.charge = 1 THEN pk.a_found ELSE pk.b_found END) THEN
            sh := pair[pk.charge];
            IF (CASE WHEN pk.charge = 1 THEN pk.lv_b ELSE pk.lv_a END) >= p_count
               AND (CASE WHEN pk.charge = 1 THEN pk.b_found ELSE pk.a_found END) THEN
                tries := 2;
            END IF;
        END IF;
        FOR j IN 1 .. CASE WHEN sh IS NULL THEN 0 ELSE tries END LOOP
            WITH l AS (
                SELECT l.ctid FROM txlimit_state l
                WHERE l.name = p_name AND l.key = p_key AND l.shard = sh FOR UPDATE SKIP LOCKED
            ), u AS (
                UPDATE txlimit_state s
                SET value = txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, p_rate, p_period_us, p_step_us, p_cap),
                                         0, p_count),
                    ts = txlimit_next_ts(s.ts, t, p_step_us)
                FROM l
                WHERE s.ctid = l.ctid
                  AND txlimit_granted(1, txlimit_left(0, 1, txlimit_level(s.value, s.ts, t, p_rate, p_period_us, p_step_us,
                                                                          p_cap), 0, p_count), 0, p_allow)
                RETURNING s.value, s.ts
            )
            SELECT EXISTS (SELECT FROM l), (SELECT u.value FROM u), (SELECT u.ts FROM u) INTO got, v, vts;
            other := CASE WHEN sh = pair[1] THEN pk.lv_b ELSE pk.lv_a END;
            EXIT WHEN got;
            sh := CASE WHEN sh = pair[1] THEN pair[2] ELSE pair[1] END; -- held by another transaction
        END LOOP;
        IF got THEN
            held := CASE WHEN sh = greatest(pair[1], pair[2]) THEN 2 ELSE 1 END;
        END IF;
    END IF;
    IF v IS NOT NULL THEN
        RETURN QUERY SELECT v >= 0, v < 0, false, v + other, sh,
                            coalesce(CASE WHEN sh = pair[1] THEN pair[2] ELSE pair[1] END, -1), 1,
                            CASE WHEN v < 0 THEN txlimit_retry_at(p_rate, p_period_us, p_step_us, p_cap, 0, 0, false,
                                                                  v, vts, NULL, NULL, t) ELSE 0 END, t, vts;
        RETURN;
    END IF;
    -- Refused by the plan, charging both shards, a Check, or not written: the road for lists.
    IF NOT sharded THEN
        RETURN QUERY SELECT * FROM txlimit_decide_v1(t, '{0}', ARRAY[p_count], ARRAY[p_allow], ARRAY[p_dry], '{f}',
            ARRAY[p_step_us], ARRAY[p_rate], ARRAY[p_period_us], ARRAY[p_cap], ARRAY[p_anchor_us], '{1}', '{0}',
            ARRAY[p_name], ARRAY[p_key], ARRAY[p_shards[1]], held);
    ELSE
        RETURN QUERY SELECT * FROM txlimit_decide_v1(t, '{0}', ARRAY[p_count], ARRAY[p_allow], ARRAY[p_dry], '{f}',
            ARRAY[p_step_us], ARRAY[p_rate], ARRAY[p_period_us], ARRAY[p_cap], ARRAY[p_anchor_us],
            ARRAY[CASE WHEN pair[1] < pair[2] THEN 1 ELSE 2 END], ARRAY[CASE WHEN pair[1] < pair[2] THEN 2 ELSE 1 END],
            ARRAY[p_name, p_name], ARRAY[p_key, p_key], ARRAY[least(pair[1], pair[2]), greatest(pair[1], pair[2])], held);
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION txlimit_decide_one_v1(bigint, text, text, double precision, double precision, boolean, bigint,
                                    double precision, bigint, double precision, bigint, integer[], bigint);
DROP FUNCTION txlimit_decide_v1(bigint, integer[], double precision[], double precision[], boolean[], boolean[], bigint[],
                                double precision[], bigint[], double precision[], bigint[], integer[], integer[], text[],
                                text[], integer[], integer);
DROP FUNCTION txlimit_results(bigint, double precision[], double precision[], bigint[], double precision[], bigint[],
                              double precision[], integer[], integer[], integer[], boolean[], double precision[], bigint[],
                              double precision[], bigint[], double precision[], bigint[], double precision[],
                              double precision[], integer[], boolean[], boolean[]);
DROP FUNCTION txlimit_lock_row(text, text, integer, double precision, bigint, boolean, bigint);
DROP FUNCTION txlimit_fold(bigint, integer[], double precision[], double precision[], boolean[], boolean[], bigint[],
                           double precision[], bigint[], double precision[], bigint[], integer[], integer[], boolean[],
                           double precision[], bigint[], boolean[], integer[]);
DROP FUNCTION txlimit_pick(text, text, integer[], bigint, bigint, double precision, double precision, bigint,
                           double precision, bigint, double precision, bigint);
DROP FUNCTION txlimit_stale(bigint, bigint, pg_snapshot);
