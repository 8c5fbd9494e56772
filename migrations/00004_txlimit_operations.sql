-- +goose Up

-- The operations other than deciding: State (txlimit_levels_v1), Credit (txlimit_credit_v1) and
-- Reset (txlimit_reset_v1), each called by the one statement of its call
-- (internal/dbsqlc/queries/state.sql). They are functions for their planner settings: as plain
-- statements their reads were planned as sequential scans on a small table, however well analysed,
-- and under SERIALIZABLE a sequential scan takes a relation-level predicate lock, so that two
-- transactions working on different keys conflicted. With sequential and bitmap scans off, as for
-- the decision (00003), every row access is a primary-key probe on a table of any size, and a
-- SERIALIZABLE transaction holds tuple or page predicate locks only. Entry points carry a version
-- in their name (CONTRIBUTING.md).

-- txlimit_levels_v1: every shard row of (p_name, p_key), read without locking, evaluated at the
-- clock: the stored value and ts and the tokens it holds now (level), in shard order. There is
-- always at least one row, carrying the clock (now_us); a single row with shard -1 means the key
-- has no rows.
-- +goose StatementBegin
CREATE FUNCTION txlimit_levels_v1(p_now_us bigint, p_name text, p_key text, p_rate double precision, p_period_us bigint,
                                  p_step_us bigint, p_cap double precision)
RETURNS TABLE (shard integer, value double precision, ts_us bigint, level double precision, now_us bigint)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
    t bigint := txlimit_clock(p_now_us);
BEGIN
    RETURN QUERY
    SELECT coalesce(s.shard, -1), coalesce(s.value, 0), coalesce(s.ts, 0),
           coalesce(txlimit_level(s.value, s.ts, t, p_rate, p_period_us, p_step_us, p_cap), 0), t
    FROM (SELECT) AS one
    LEFT JOIN txlimit_state s ON s.name = p_name AND s.key = p_key
    ORDER BY s.shard;
END
$$;
-- +goose StatementEnd

-- txlimit_hold_shards: holds, in shard order, every shard of (p_name, p_key) below p_shards (NULL:
-- every shard) up to the key's highest row, so that Credit and Reset act on the key as it is at one
-- instant, as they would in a serial order: an existing row by its row lock (FOR UPDATE, which
-- waits for a transaction writing it), a missing one by the advisory lock that creates it
-- (txlimit_create_key; a decision holds it from before it inserts the row until it ends, so taking
-- it waits for a decision creating the row, and holding it keeps the row missing).
-- Under READ COMMITTED each probe reads the latest committed rows, so that a row created by a
-- decision this call waited for is seen and held, and the highest row is read again until none lies
-- beyond those held. Returns how many shards are held, from 0: every row of the key below that is
-- held (a missing one stays missing), and when last read the key had no row from there on (below
-- p_shards); a row created there since was created after that instant. Runs within its callers'
-- planner settings (primary-key probes only).
-- +goose StatementBegin
CREATE FUNCTION txlimit_hold_shards(p_name text, p_key text, p_shards integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    bound integer := coalesce(p_shards, 2147483647);
    held integer := 0;
    top integer;
BEGIN
    LOOP
        SELECT max(s.shard) INTO top FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard < bound;
        IF top IS NULL OR top < held THEN
            RETURN held;
        END IF;
        FOR sh IN held .. top LOOP
            PERFORM FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard = sh FOR UPDATE;
            IF NOT FOUND THEN
                PERFORM pg_advisory_xact_lock(txlimit_create_key(p_name, p_key, sh));
                -- Created by a transaction that ended meanwhile: lock it.
                PERFORM FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard = sh FOR UPDATE;
            END IF;
        END LOOP;
        held := top + 1;
    END LOOP;
END
$$;
-- +goose StatementEnd

-- txlimit_credit_v1: Credit. It gives p_count tokens back to the shard rows 0 .. p_shards - 1 of
-- (p_name, p_key), never above p_cap (the per-shard capacity). The shards are held in shard order
-- first (txlimit_hold_shards), so that the credit sees every shard as at one instant, and the
-- tokens go to the emptiest shards first: each shard takes what the shards before it could not. A
-- missing row is full and takes nothing, so a credit never creates a row. Returns every
-- existing shard row with its level before and after, or a single row with shard -1 (carrying the
-- clock, now_us) when there is none.
-- +goose StatementBegin
CREATE FUNCTION txlimit_credit_v1(p_now_us bigint, p_name text, p_key text, p_shards integer, p_count double precision,
                                  p_rate double precision, p_period_us bigint, p_step_us bigint, p_cap double precision)
RETURNS TABLE (shard integer, before double precision, after double precision, now_us bigint)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
    t bigint := txlimit_clock(p_now_us);
    held integer := txlimit_hold_shards(p_name, p_key, p_shards);
BEGIN
    RETURN QUERY
    WITH lk AS MATERIALIZED ( -- the rows held, in their latest version
        SELECT s.shard, s.value, s.ts
        FROM txlimit_state s
        WHERE s.name = p_name AND s.key = p_key AND s.shard < held
        ORDER BY s.shard
        FOR UPDATE
    ),
    give AS MATERIALIZED (
        SELECT e.shard, e.lv, e.ts,
               least(e.lv + greatest(p_count - coalesce(sum(p_cap - e.lv)
                         OVER (ORDER BY e.lv, e.shard ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0), 0),
                     p_cap) AS after
        FROM (SELECT l.shard, txlimit_level(l.value, l.ts, t, p_rate, p_period_us, p_step_us, p_cap) AS lv,
                     txlimit_next_ts(l.ts, t, p_step_us) AS ts
              FROM lk l) e
    ),
    upd AS (
        UPDATE txlimit_state s
        SET value = g.after, ts = g.ts
        FROM give g
        WHERE s.name = p_name AND s.key = p_key AND s.shard = g.shard AND g.after > g.lv
    )
    SELECT coalesce(g.shard, -1), coalesce(g.lv, 0), coalesce(g.after, 0), t
    FROM (SELECT) AS one
    LEFT JOIN give g ON true
    ORDER BY g.shard;
END
$$;
-- +goose StatementEnd

-- txlimit_reset_v1: Reset. It deletes every shard row of (p_name, p_key), shards beyond any
-- config's count included, and returns how many. The shards are held first, in shard order
-- (txlimit_hold_shards: the global order (name, key, shard) of every call), and the DELETE removes
-- the rows held, each in its latest version, among them any row created by a decision that Reset
-- waited for.
-- +goose StatementBegin
CREATE FUNCTION txlimit_reset_v1(p_name text, p_key text)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off SET enable_bitmapscan = off
AS $$
DECLARE
    held integer := txlimit_hold_shards(p_name, p_key, NULL);
    n bigint;
BEGIN
    DELETE FROM txlimit_state s WHERE s.name = p_name AND s.key = p_key AND s.shard < held;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION IF EXISTS txlimit_reset_v1(text, text);
DROP FUNCTION IF EXISTS txlimit_credit_v1(bigint, text, text, integer, double precision, double precision, bigint, bigint,
                                          double precision);
DROP FUNCTION IF EXISTS txlimit_hold_shards(text, text, integer);
DROP FUNCTION IF EXISTS txlimit_levels_v1(bigint, text, text, double precision, bigint, bigint, double precision);
