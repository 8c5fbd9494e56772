-- +goose Up

-- txlimit_decide_sharded decides one request on a sharded limit; the query DecideSharded is a call
-- of it, so a decision is still one statement and one round trip. It replaces a single statement
-- of some twenty CTEs that did the same steps: that plan had well over a hundred nodes, and
-- starting and ending them on every call, whichever path the call took, cost more than the
-- decision itself, most of all under concurrency: on the 2-core test machine (make bench-full),
-- 64 callers of one 16-shard key made 1,289 decisions/s with it on a pool and 867 in SERIALIZABLE
-- transactions, against 3,183 and 1,991 with this function. Here only the steps a call takes run,
-- each a primary-key probe with a cached plan.
--
-- Arguments, all required except p_now: p_now is the instant to evaluate at (NULL: the database's
-- clock, clock_timestamp()); p_dry asks for a decision that locks and writes nothing; p_cands lists
-- candidate shards in random order (the caller's two picks first, all distinct, at least two);
-- p_lock_base is the hash of (name, key) the advisory locks are keyed on; the rest is the limit's
-- config as the Go package normalises it (p_kind 0 token bucket, 1 fixed window; p_max_reserved
-- < 0 means unbounded).
--
-- Statuses: 0 granted and written, 1 denied after the lock, 2 decided without a lock (dry run or
-- fast denial), 3 re-run needed (missing rows created, or a charged row vanished), 4 busy: every
-- candidate is taken under a snapshot isolation level; nothing was read or written. charge is 1
-- (shard_a charged), 2 (shard_b) or 3 (both, so that they end equal); the levels, ends and
-- timestamps are those the decision was made on. A busy call returns zeros beside its status.
--
-- Choosing shard_a. It is the first candidate that no other transaction is deciding on: one whose
-- transaction-scoped advisory lock (p_lock_base XOR this table's OID shifted left 20 bits, so that
-- schemas do not share locks, XOR the shard) this transaction can take without waiting. The lock is
-- a hint, never waited on and never needed for correctness (the row locks below are): it steers
-- concurrent callers of a hot key to different shards before they read any row.
--
-- Under REPEATABLE READ or SERIALIZABLE a candidate must also not be stale: a row that a
-- transaction this snapshot cannot see has updated (or holds) cannot be locked from this snapshot
-- without a serialization failure, so it is passed over too. Stale means the version this snapshot
-- sees has an xmax that is not visible in the snapshot and has not aborted. xmax is 32 bits; it is
-- widened to an xid8 next to the snapshot's xmax r (live xids are within 2^31 of it), and
-- pg_xact_status is asked only about xids below r, which cannot be in the future; an xid at or
-- above r started after the snapshot and counts as stale whatever became of it. The version a
-- charge leaves carries its own transaction as a lock-only xmax, which every later snapshot sees,
-- so a quiet row is never stale. An xmax that is a MultiXactId (left by share locks, or by
-- savepoints locking a row twice) is read as some xid: at worst the row looks stale to snapshot
-- transactions until VACUUM clears it, and they use the other shards meanwhile. A stale candidate
-- keeps its advisory lock until the transaction ends. Missing rows are never stale. The read that
-- tests staleness is also the lock-free read of the chosen shard.
--
-- When every candidate is taken, shard_a is the first candidate: under READ COMMITTED the call goes
-- on (and may wait for its row); under REPEATABLE READ or SERIALIZABLE it is busy, since going on
-- would almost surely end in a serialization failure. shard_b is the candidate after shard_a. A dry
-- run takes no lock: they are the first two.
--
-- Reading shard_b. Under REPEATABLE READ or SERIALIZABLE a row that is read but not charged makes
-- this transaction a reader of whoever charges it, and with many callers such read/write
-- dependencies form cycles that SERIALIZABLE aborts; there shard_b is read only when shard_a cannot
-- serve the request alone. Under READ COMMITTED reads cost nothing, and both are always read
-- (power-of-two choice). Missing rows count as full.
--
-- Planning on the lock-free read: txlimit_charge chooses the rows to charge; a denial there is
-- answered without a lock or a write. When both rows are to be charged and one is missing, the
-- missing rows are only created full (in shard order, ON CONFLICT DO NOTHING) and a re-run is asked
-- for.
--
-- Locking. Both charged: both, the lower shard first, waiting. One charged: try it without waiting
-- (SKIP LOCKED); when another caller holds it, take the other candidate instead if the lock-free
-- read showed it can serve alone (SKIP LOCKED too, or inserting it when it is missing), and wait
-- for the first only when both are taken. A caller queued behind a holder only waits for its commit
-- (and under SERIALIZABLE then fails on it); switching keeps callers on different rows. No caller
-- waits while it holds a row lock, so this adds no deadlock.
--
-- Deciding on the locked rows' latest versions: the charge is chosen again with the rows locked
-- kept (txlimit_charge with fixed_charge), and only a granted decision writes: an UPDATE of each
-- charged row through its whole primary key, or an INSERT ON CONFLICT DO NOTHING of a single
-- charged row that is missing (a conflict asks for a re-run). Every access is one primary-key probe,
-- so under SERIALIZABLE a decision holds predicate locks on the rows it reads only.
-- +goose StatementBegin
CREATE FUNCTION txlimit_decide_sharded(
    p_now timestamptz, p_dry boolean, p_cands integer[], p_lock_base bigint,
    p_name text, p_key text, p_cap double precision, p_kind smallint, p_rate double precision,
    p_period_us bigint, p_count double precision, p_reserve boolean, p_max_reserved double precision,
    p_anchor_us bigint,
    OUT status integer, OUT charge integer, OUT shard_a integer, OUT shard_b integer,
    OUT ok_now boolean, OUT reserved boolean, OUT level_a double precision, OUT level_b double precision,
    OUT end_a double precision, OUT end_b double precision, OUT ts_a_us bigint, OUT ts_b_us bigint,
    OUT now_us bigint)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    n        integer := cardinality(p_cands);
    snap_iso boolean := current_setting('transaction_isolation') IN ('serializable', 'repeatable read');
    base     bigint;
    snap     pg_snapshot;
    r        bigint;
    x        bigint;
    xm       bigint;
    pos      integer;
    cand     integer;
    have_a   boolean := false;
    -- The lock-free reads (NULL value: the row is missing) and what they plan.
    va double precision; ta bigint; vb double precision; tb bigint;
    two boolean := false;
    lv_a double precision; lv_b double precision := 0;
    a_missing boolean; b_missing boolean;
    plan_charge integer; low double precision; locking boolean; prefill boolean;
    -- The locks taken and the versions decided on.
    pick integer; other integer; pick_exists boolean; other_exists boolean; other_fits boolean;
    pv double precision; pt bigint; ov double precision; ot bigint;
    got_pick boolean := false; got_other boolean := false; switched boolean := false;
    la boolean := false; lb boolean := false; vanished boolean := false;
    lva double precision; lta bigint; lvb double precision; ltb bigint;
    locked_charge integer; fresh_ts bigint;
    written bigint := 0; k bigint;
BEGIN
    now_us := (extract(epoch FROM coalesce(p_now, clock_timestamp())) * 1000000)::bigint;
    status := 4; charge := 0; ok_now := false; reserved := false;
    level_a := 0; level_b := 0; end_a := 0; end_b := 0; ts_a_us := 0; ts_b_us := 0;

    -- shard_a: the first candidate whose advisory lock is free (and, under a snapshot, not stale).
    IF NOT p_dry THEN
        base := p_lock_base # ('txlimit_state'::regclass::oid::bigint << 20);
        IF snap_iso THEN
            snap := pg_current_snapshot();
            r := pg_snapshot_xmax(snap)::text::bigint;
        END IF;
        FOR i IN 1 .. n LOOP
            cand := p_cands[i];
            CONTINUE WHEN NOT pg_try_advisory_xact_lock(base # cand::bigint);
            IF snap_iso THEN
                SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint, s.xmax::text::bigint
                INTO va, ta, xm
                FROM txlimit_state s
                WHERE s.name = p_name AND s.key = p_key AND s.shard = cand;
                IF xm IS NOT NULL AND xm <> 0 THEN
                    x := r + ((xm - (r & 4294967295)) % 4294967296 + 4294967296 + 2147483648) % 4294967296 - 2147483648;
                    CONTINUE WHEN x >= 3 AND NOT pg_visible_in_snapshot(x::text::xid8, snap)
                                  AND (x >= r OR pg_xact_status(x::text::xid8) IS DISTINCT FROM 'aborted');
                END IF;
                have_a := true;
            END IF;
            pos := i;
            EXIT;
        END LOOP;
        IF pos IS NULL AND snap_iso THEN
            shard_a := p_cands[1];
            shard_b := p_cands[2];
            RETURN; -- busy
        END IF;
    END IF;
    pos := coalesce(pos, 1);
    shard_a := p_cands[pos];
    shard_b := p_cands[pos % n + 1];

    -- The lock-free reads.
    IF NOT have_a THEN
        SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO va, ta
        FROM txlimit_state s
        WHERE s.name = p_name AND s.key = p_key AND s.shard = shard_a;
    END IF;
    lv_a := CASE WHEN va IS NULL THEN p_cap
                 ELSE txlimit_level(p_kind, va, ta, now_us, p_rate, p_period_us, p_cap) END;
    two := NOT snap_iso OR lv_a < p_count;
    IF two THEN
        SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO vb, tb
        FROM txlimit_state s
        WHERE s.name = p_name AND s.key = p_key AND s.shard = shard_b;
        lv_b := CASE WHEN vb IS NULL THEN p_cap
                     ELSE txlimit_level(p_kind, vb, tb, now_us, p_rate, p_period_us, p_cap) END;
    END IF;

    -- The plan on them.
    a_missing := va IS NULL;
    b_missing := two AND vb IS NULL;
    plan_charge := txlimit_charge(lv_a, lv_b, two, p_count, 0);
    -- What the charged row (either one, when both end equal) holds afterwards.
    low := txlimit_left(CASE WHEN plan_charge = 2 THEN 1 ELSE 0 END, plan_charge, lv_a, lv_b, p_count);
    locking := NOT p_dry
               AND (low >= 0 OR (p_reserve AND (p_max_reserved < 0 OR -low <= p_max_reserved)));
    prefill := locking AND plan_charge = 3 AND (a_missing OR b_missing);
    locking := locking AND NOT prefill;

    IF prefill THEN
        INSERT INTO txlimit_state (name, key, shard, value, ts)
        SELECT p_name, p_key, m.sh, p_cap,
               'epoch'::timestamptz + (CASE WHEN p_kind = 0 THEN 0 ELSE p_anchor_us END) * interval '1 microsecond'
        FROM (VALUES (shard_a, a_missing), (shard_b, b_missing)) AS m(sh, missing)
        WHERE m.missing
        ORDER BY m.sh
        ON CONFLICT DO NOTHING;
    END IF;

    -- The locks.
    IF locking AND plan_charge IN (1, 2) THEN
        pick := CASE WHEN plan_charge = 2 THEN shard_b ELSE shard_a END;
        other := CASE WHEN plan_charge = 2 THEN shard_a ELSE shard_b END;
        pick_exists := CASE WHEN plan_charge = 2 THEN NOT b_missing ELSE NOT a_missing END;
        other_exists := CASE WHEN plan_charge = 2 THEN NOT a_missing ELSE NOT b_missing END;
        other_fits := two AND CASE WHEN plan_charge = 2 THEN lv_a ELSE lv_b END >= p_count;
        IF pick_exists THEN
            SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO pv, pt
            FROM txlimit_state s
            WHERE s.name = p_name AND s.key = p_key AND s.shard = pick
            FOR UPDATE SKIP LOCKED;
            got_pick := FOUND;
            IF NOT got_pick AND other_fits THEN
                IF other_exists THEN
                    SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO ov, ot
                    FROM txlimit_state s
                    WHERE s.name = p_name AND s.key = p_key AND s.shard = other
                    FOR UPDATE SKIP LOCKED;
                    got_other := FOUND;
                    switched := got_other;
                ELSE
                    switched := true; -- the other row is missing: it is inserted below
                END IF;
            END IF;
            IF NOT got_pick AND NOT switched THEN
                SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO pv, pt
                FROM txlimit_state s
                WHERE s.name = p_name AND s.key = p_key AND s.shard = pick
                FOR UPDATE;
                got_pick := FOUND;
            END IF;
        END IF;
    ELSIF locking THEN
        -- Both, the lower shard first: the global lock order.
        pick := least(shard_a, shard_b);
        other := greatest(shard_a, shard_b);
        SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO pv, pt
        FROM txlimit_state s
        WHERE s.name = p_name AND s.key = p_key AND s.shard = pick
        FOR UPDATE;
        got_pick := FOUND;
        SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint INTO ov, ot
        FROM txlimit_state s
        WHERE s.name = p_name AND s.key = p_key AND s.shard = other
        FOR UPDATE;
        got_other := FOUND;
    END IF;
    IF pick = shard_a THEN
        la := got_pick; lva := pv; lta := pt;
        lb := got_other; lvb := ov; ltb := ot;
    ELSE
        lb := got_pick; lvb := pv; ltb := pt;
        la := got_other; lva := ov; lta := ot;
    END IF;

    -- The versions decided on: a locked row's latest version, else the lock-free read; a row that
    -- was to be charged but could not be locked counts as missing (and, when both are charged, as
    -- vanished: a re-run). charge is the rows actually locked: the other candidate's when the call
    -- switched to it.
    locked_charge := CASE WHEN switched THEN 3 - plan_charge ELSE plan_charge END;
    IF locking THEN
        vanished := (locked_charge IN (1, 3) AND va IS NOT NULL AND NOT la)
                    OR (locked_charge IN (2, 3) AND vb IS NOT NULL AND NOT lb);
        IF la THEN va := lva; ta := lta; ELSIF locked_charge IN (1, 3) THEN va := NULL; END IF;
        IF lb THEN vb := lvb; tb := ltb; ELSIF locked_charge IN (2, 3) THEN vb := NULL; END IF;
    END IF;
    level_a := CASE WHEN va IS NULL THEN p_cap
                    ELSE txlimit_level(p_kind, va, ta, now_us, p_rate, p_period_us, p_cap) END;
    level_b := CASE WHEN NOT two THEN 0
                    WHEN vb IS NULL THEN p_cap
                    ELSE txlimit_level(p_kind, vb, tb, now_us, p_rate, p_period_us, p_cap) END;
    -- A missing row is written with ts now (token bucket) or the start of now's window.
    fresh_ts := CASE WHEN p_kind = 0 THEN now_us
                     ELSE now_us - ((now_us - p_anchor_us) % p_period_us + p_period_us) % p_period_us END;
    ts_a_us := CASE WHEN va IS NOT NULL THEN txlimit_next_ts(p_kind, ta, now_us, p_period_us) ELSE fresh_ts END;
    ts_b_us := CASE WHEN NOT two THEN 0
                    WHEN vb IS NOT NULL THEN txlimit_next_ts(p_kind, tb, now_us, p_period_us)
                    ELSE fresh_ts END;

    -- The decision, with the rows locked kept.
    charge := txlimit_charge(level_a, level_b, two, p_count, locked_charge);
    end_a := txlimit_left(0, charge, level_a, level_b, p_count);
    end_b := txlimit_left(1, charge, level_a, level_b, p_count);
    low := CASE charge WHEN 1 THEN end_a WHEN 2 THEN end_b ELSE least(end_a, end_b) END;
    ok_now := low >= 0;
    reserved := low < 0 AND p_reserve AND (p_max_reserved < 0 OR -low <= p_max_reserved);

    -- Both rows were locked to be charged and one has vanished (a concurrent Reset or Prune under
    -- READ COMMITTED): nothing is written and the call runs again on what is there now.
    IF prefill OR (locking AND locked_charge = 3 AND vanished) THEN
        status := 3;
        RETURN;
    END IF;
    IF NOT locking THEN
        status := 2;
        RETURN;
    END IF;
    IF NOT (ok_now OR reserved) THEN
        status := 1;
        RETURN;
    END IF;

    -- The writes: each charged row through its whole primary key, one statement per row (one
    -- UPDATE over both, joined on the shard, can plan as a scan of the key's shards, and under
    -- SERIALIZABLE a scan that reads more than two tuples of a page locks the whole page).
    IF charge <> 3 AND (CASE WHEN charge = 1 THEN va ELSE vb END) IS NULL THEN
        INSERT INTO txlimit_state (name, key, shard, value, ts)
        VALUES (p_name, p_key,
                CASE WHEN charge = 1 THEN shard_a ELSE shard_b END,
                CASE WHEN charge = 1 THEN end_a ELSE end_b END,
                'epoch'::timestamptz + (CASE WHEN charge = 1 THEN ts_a_us ELSE ts_b_us END) * interval '1 microsecond')
        ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS k = ROW_COUNT;
        written := written + k;
    END IF;
    IF charge IN (1, 3) AND va IS NOT NULL THEN
        UPDATE txlimit_state s
        SET value = end_a, ts = 'epoch'::timestamptz + ts_a_us * interval '1 microsecond'
        WHERE s.name = p_name AND s.key = p_key AND s.shard = shard_a;
        GET DIAGNOSTICS k = ROW_COUNT;
        written := written + k;
    END IF;
    IF charge IN (2, 3) AND vb IS NOT NULL THEN
        UPDATE txlimit_state s
        SET value = end_b, ts = 'epoch'::timestamptz + ts_b_us * interval '1 microsecond'
        WHERE s.name = p_name AND s.key = p_key AND s.shard = shard_b;
        GET DIAGNOSTICS k = ROW_COUNT;
        written := written + k;
    END IF;
    status := CASE WHEN written = 0 THEN 3 ELSE 0 END;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION txlimit_decide_sharded(timestamptz, boolean, integer[], bigint, text, text, double precision,
                                     smallint, double precision, bigint, double precision, boolean,
                                     double precision, bigint);
