-- name: DecideSharded :one
-- DecideSharded is Decide for one request on a sharded limit. It chooses its two candidate shards
-- from cands (see pk below) and returns them as shard_a and shard_b. It follows Decide's steps as a
-- pipeline of one-row steps, with the two candidates side by side (a fraction of the work of Decide's row-per-candidate plan): a lock-free
-- read and a plan on it; a denial there is answered without a lock or a write; otherwise only the
-- rows to be charged are locked (see ord below), the plan is re-decided on their latest
-- versions, and they are updated, or inserted ON CONFLICT DO NOTHING when a single charged row is
-- missing. When both rows are charged and some are missing, it only creates them full and asks for
-- a re-run, as Decide does. Every access is one primary-key probe, so under SERIALIZABLE a decision
-- holds predicate locks on the rows it reads only. The nested subqueries end in OFFSET 0 so that
-- the planner keeps them apart: flattened, every use of a computed column would re-expand the
-- inlined txlimit_* expressions that define it, and the one-row arithmetic would cost more than
-- the rest of the statement. Statuses are Decide's: 0 granted and written,
-- 1 denied after the lock, 2 decided without a lock (dry run or fast denial), 3 re-run needed;
-- and 4, busy (see pk): nothing read or written.
WITH clock AS MATERIALIZED (
    SELECT (extract(epoch FROM coalesce(sqlc.narg('now')::timestamptz, clock_timestamp())) * 1000000)::bigint AS now_us,
           current_setting('transaction_isolation') IN ('serializable', 'repeatable read') AS snapshot_iso
),
-- The two picks. cands lists candidate shards in random order (the caller's two picks first). The
-- first pick, a, is the first candidate that no other transaction is deciding on: one whose
-- transaction-scoped advisory lock (lock_base, XOR this table's OID shifted left 20 bits so that
-- schemas do not share locks, XOR the shard) this transaction can take without waiting.
-- The lock is a hint, never waited on and never needed for correctness (the row locks below are):
-- it steers concurrent callers of a hot key to different shards before they read any row.
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
-- keeps its advisory lock until the transaction ends. Missing rows are never stale.
--
-- When every candidate is taken, a is the first candidate: under READ COMMITTED the call goes on
-- (and may wait for its row); under REPEATABLE READ or SERIALIZABLE it is busy: it reads and
-- writes nothing more, and the Limiter reports a serialization failure at once, since going on
-- would almost surely end in one. The second pick, b, is the candidate after a. A dry run takes
-- no lock: a and b are the first two.
pk AS MATERIALIZED (
    SELECT k.now_us, k.snapshot_iso,
           k.snapshot_iso AND NOT sqlc.arg('dry')::boolean AND f.i IS NULL AS busy,
           ((sqlc.arg('cands')::integer[])[coalesce(f.i, 1)])::integer AS sa,
           ((sqlc.arg('cands')::integer[])[coalesce(f.i, 1) % cardinality(sqlc.arg('cands')::integer[]) + 1])::integer AS sb
    FROM clock k
    CROSS JOIN (SELECT cs.snap, pg_snapshot_xmax(cs.snap)::text::bigint AS r,
                       sqlc.arg('lock_base')::bigint # ('txlimit_state'::regclass::oid::bigint << 20) AS base
                FROM (SELECT pg_current_snapshot() AS snap) cs) z
    LEFT JOIN LATERAL (
        SELECT c.i
        FROM unnest(sqlc.arg('cands')::integer[]) WITH ORDINALITY AS c(shard, i)
        WHERE CASE WHEN sqlc.arg('dry')::boolean THEN false
                   WHEN NOT pg_try_advisory_xact_lock(z.base # c.shard::bigint) THEN false
                   WHEN NOT k.snapshot_iso THEN true
                   ELSE NOT EXISTS (
                       SELECT 1
                       FROM txlimit_state st
                       CROSS JOIN LATERAL (
                           SELECT z.r + ((st.xmax::text::bigint - (z.r & 4294967295)) % 4294967296
                                         + 4294967296 + 2147483648) % 4294967296 - 2147483648 AS x
                       ) wx
                       CROSS JOIN LATERAL (SELECT CASE WHEN wx.x >= 3 THEN wx.x::text::xid8 END AS x8) q
                       WHERE st.name = sqlc.arg('name')::text AND st.key = sqlc.arg('key')::text AND st.shard = c.shard
                         AND st.xmax <> '0'::xid
                         AND NOT pg_visible_in_snapshot(q.x8, z.snap)
                         AND CASE WHEN wx.x >= z.r THEN true
                                  ELSE pg_xact_status(q.x8) IS DISTINCT FROM 'aborted'
                             END
                   )
              END
        LIMIT 1
    ) f ON true
),
-- The first pick, and the tokens it holds on the lock-free read.
pa AS MATERIALIZED (
    SELECT k.now_us, k.snapshot_iso, k.busy, k.sa, k.sb, s.value, s.ts_us,
           CASE WHEN s.value IS NULL THEN sqlc.arg('cap')::double precision
                ELSE txlimit_level(sqlc.arg('kind')::smallint, s.value, s.ts_us, k.now_us, sqlc.arg('rate')::double precision,
                                   sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision)
           END AS lv
    FROM pk k
    LEFT JOIN LATERAL (
        SELECT st.value, (extract(epoch FROM st.ts) * 1000000)::bigint AS ts_us
        FROM txlimit_state st
        WHERE NOT k.busy AND st.name = sqlc.arg('name')::text AND st.key = sqlc.arg('key')::text AND st.shard = k.sa
        LIMIT 1
    ) s ON true
),
-- The second pick. Under REPEATABLE READ or SERIALIZABLE a row that is read but not charged makes
-- this transaction a reader of whoever charges it, and with many callers such read/write
-- dependencies form cycles that SERIALIZABLE aborts; there the second shard is read only when the
-- first cannot serve the request alone. Under READ COMMITTED reads cost nothing, and both are
-- always read (power-of-two choice).
pb AS MATERIALIZED (
    SELECT r.read, s.value, s.ts_us,
           CASE WHEN NOT r.read THEN 0
                WHEN s.value IS NULL THEN sqlc.arg('cap')::double precision
                ELSE txlimit_level(sqlc.arg('kind')::smallint, s.value, s.ts_us, r.now_us, sqlc.arg('rate')::double precision,
                                   sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision)
           END AS lv
    FROM (SELECT a.now_us, a.sb, NOT a.busy AND (NOT a.snapshot_iso OR a.lv < sqlc.arg('count')::double precision) AS read FROM pa a) r
    LEFT JOIN LATERAL (
        SELECT st.value, (extract(epoch FROM st.ts) * 1000000)::bigint AS ts_us
        FROM txlimit_state st
        WHERE r.read
          AND st.name = sqlc.arg('name')::text AND st.key = sqlc.arg('key')::text AND st.shard = r.sb
        LIMIT 1
    ) s ON true
),
-- The plan on the lock-free read: which rows to charge, whether it is granted, what to lock.
p0 AS MATERIALIZED (
    SELECT c.*,
           NOT sqlc.arg('dry')::boolean AND NOT c.busy AND c.granted AND NOT (c.charge = 3 AND (c.a_missing OR c.b_missing)) AS locking,
           NOT sqlc.arg('dry')::boolean AND NOT c.busy AND c.granted AND c.charge = 3 AND (c.a_missing OR c.b_missing) AS prefill
    FROM (
        SELECT x.*,
               x.low >= 0 OR (sqlc.arg('reserve')::boolean AND (sqlc.arg('max_reserved')::double precision < 0
                                                                OR -x.low <= sqlc.arg('max_reserved')::double precision)) AS granted
        FROM (
            SELECT y.*,
                   CASE WHEN y.charge = 3 THEN least(txlimit_left(0, 3, y.lv_a, y.lv_b, sqlc.arg('count')::double precision),
                                                     txlimit_left(1, 3, y.lv_a, y.lv_b, sqlc.arg('count')::double precision))
                        ELSE txlimit_left(y.charge - 1, y.charge, y.lv_a, y.lv_b, sqlc.arg('count')::double precision)
                   END AS low
            FROM (
                SELECT a.busy, a.sa, a.sb, a.lv AS lv_a, b.lv AS lv_b, b.read AS two,
                       a.value IS NULL AS a_missing, b.read AND b.value IS NULL AS b_missing,
                       txlimit_charge(a.lv, b.lv, b.read, sqlc.arg('count')::double precision, 0) AS charge
                FROM pa a CROSS JOIN pb b
                OFFSET 0
            ) y
            OFFSET 0
        ) x
        OFFSET 0
    ) c
),
-- Which rows to lock. Both charged: both, the lower shard first, waiting. One charged: try it
-- without waiting (SKIP LOCKED); when another caller holds it, take the other pick instead if the
-- lock-free read showed it can serve alone (SKIP LOCKED too, or inserting it when it is missing),
-- and wait for the first only when both are taken. A caller queued behind a holder only waits for
-- its commit (and under SERIALIZABLE then fails on it); switching keeps callers on different rows.
-- No caller waits while it holds a lock, so this adds no deadlock.
ord AS MATERIALIZED (
    SELECT p.locking, p.charge, p.sa, p.sb,
           p.charge IN (1, 2) AS single,
           CASE WHEN p.charge = 2 THEN p.sb ELSE p.sa END AS pick,
           CASE WHEN p.charge = 2 THEN p.sa ELSE p.sb END AS other,
           CASE WHEN p.charge = 2 THEN NOT p.b_missing ELSE NOT p.a_missing END AS pick_exists,
           CASE WHEN p.charge = 2 THEN NOT p.a_missing ELSE NOT p.b_missing END AS other_exists,
           p.two AND CASE WHEN p.charge = 2 THEN p.lv_a ELSE p.lv_b END >= sqlc.arg('count')::double precision AS other_fits
    FROM p0 p
),
try AS MATERIALIZED (
    SELECT st.shard, st.value, st.ts
    FROM ord o
    CROSS JOIN LATERAL (
        SELECT s.shard, s.value, s.ts
        FROM txlimit_state s
        WHERE o.locking AND o.single AND o.pick_exists AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = o.pick
        FOR UPDATE SKIP LOCKED
    ) st
),
skip AS MATERIALIZED (
    SELECT o.*, o.locking AND o.single AND o.pick_exists AND NOT EXISTS (SELECT 1 FROM try) AS skipped
    FROM ord o
),
alt AS MATERIALIZED (
    SELECT st.shard, st.value, st.ts
    FROM skip o
    CROSS JOIN LATERAL (
        SELECT s.shard, s.value, s.ts
        FROM txlimit_state s
        WHERE o.skipped AND o.other_fits AND o.other_exists AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = o.other
        FOR UPDATE SKIP LOCKED
    ) st
),
sw AS MATERIALIZED (
    SELECT o.*, o.skipped AND o.other_fits AND (NOT o.other_exists OR EXISTS (SELECT 1 FROM alt)) AS switched
    FROM skip o
),
wt AS MATERIALIZED (
    SELECT st.shard, st.value, st.ts
    FROM sw o
    CROSS JOIN LATERAL (
        SELECT s.shard, s.value, s.ts
        FROM txlimit_state s
        WHERE o.skipped AND NOT o.switched AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = o.pick
        FOR UPDATE
    ) st
),
lk1 AS MATERIALIZED (
    SELECT st.shard, st.value, st.ts
    FROM ord o
    CROSS JOIN LATERAL (
        SELECT s.shard, s.value, s.ts
        FROM txlimit_state s
        WHERE o.locking AND o.charge = 3 AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = least(o.sa, o.sb)
        FOR UPDATE
    ) st
),
lk2 AS MATERIALIZED (
    SELECT st.shard, st.value, st.ts
    FROM ord o
    CROSS JOIN LATERAL (
        SELECT s.shard, s.value, s.ts
        FROM txlimit_state s
        WHERE o.locking AND o.charge = 3
          AND (SELECT count(*) FROM lk1) >= 0 -- after lk1: the global lock order
          AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = greatest(o.sa, o.sb)
        FOR UPDATE
    ) st
),
locked AS MATERIALIZED (
    SELECT l.shard, l.value, (extract(epoch FROM l.ts) * 1000000)::bigint AS ts_us
    FROM (
        SELECT * FROM try UNION ALL SELECT * FROM alt UNION ALL SELECT * FROM wt
        UNION ALL SELECT * FROM lk1 UNION ALL SELECT * FROM lk2
    ) l
),
-- Each candidate as decided on: a locked row's latest version, else the lock-free read. charge is
-- the rows actually charged: the other pick's when the call switched to it.
cur AS MATERIALIZED (
    SELECT k.now_us, p.busy, p.sa, p.sb, o.charge, p.two, p.locking, p.prefill,
           CASE WHEN la.shard IS NOT NULL THEN la.value WHEN p.locking AND o.charge IN (1, 3) THEN NULL ELSE a.value END AS va,
           CASE WHEN la.shard IS NOT NULL THEN la.ts_us ELSE a.ts_us END AS ta,
           CASE WHEN lb.shard IS NOT NULL THEN lb.value WHEN p.locking AND o.charge IN (2, 3) THEN NULL ELSE b.value END AS vb,
           CASE WHEN lb.shard IS NOT NULL THEN lb.ts_us ELSE b.ts_us END AS tb,
           p.locking AND ((o.charge IN (1, 3) AND a.value IS NOT NULL AND la.shard IS NULL)
                          OR (o.charge IN (2, 3) AND b.value IS NOT NULL AND lb.shard IS NULL)) AS vanished
    FROM clock k
    CROSS JOIN p0 p
    CROSS JOIN (SELECT CASE WHEN s.switched THEN 3 - s.charge ELSE s.charge END AS charge FROM sw s) o
    CROSS JOIN pa a
    CROSS JOIN pb b
    LEFT JOIN LATERAL (SELECT l.shard, l.value, l.ts_us FROM locked l WHERE l.shard = p.sa) la ON true
    LEFT JOIN LATERAL (SELECT l.shard, l.value, l.ts_us FROM locked l WHERE l.shard = p.sb) lb ON true
),
-- Levels and next timestamps on those versions, and the decision with the chosen rows kept.
ev AS MATERIALIZED (
    SELECT c.*,
           CASE WHEN c.va IS NULL THEN sqlc.arg('cap')::double precision
                ELSE txlimit_level(sqlc.arg('kind')::smallint, c.va, c.ta, c.now_us, sqlc.arg('rate')::double precision,
                                   sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision)
           END AS lv_a,
           CASE WHEN NOT c.two THEN 0
                WHEN c.vb IS NULL THEN sqlc.arg('cap')::double precision
                ELSE txlimit_level(sqlc.arg('kind')::smallint, c.vb, c.tb, c.now_us, sqlc.arg('rate')::double precision,
                                   sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision)
           END AS lv_b,
           CASE WHEN c.va IS NOT NULL THEN txlimit_next_ts(sqlc.arg('kind')::smallint, c.ta, c.now_us, sqlc.arg('period_us')::bigint)
                WHEN sqlc.arg('kind')::smallint = 0 THEN c.now_us
                ELSE c.now_us - ((c.now_us - sqlc.arg('anchor_us')::bigint) % sqlc.arg('period_us')::bigint
                                 + sqlc.arg('period_us')::bigint) % sqlc.arg('period_us')::bigint
           END AS ts_a,
           CASE WHEN NOT c.two THEN 0
                WHEN c.vb IS NOT NULL THEN txlimit_next_ts(sqlc.arg('kind')::smallint, c.tb, c.now_us, sqlc.arg('period_us')::bigint)
                WHEN sqlc.arg('kind')::smallint = 0 THEN c.now_us
                ELSE c.now_us - ((c.now_us - sqlc.arg('anchor_us')::bigint) % sqlc.arg('period_us')::bigint
                                 + sqlc.arg('period_us')::bigint) % sqlc.arg('period_us')::bigint
           END AS ts_b
    FROM cur c
),
plan AS MATERIALIZED (
    SELECT d.*,
           d.low >= 0 AS ok_now,
           d.low < 0 AND sqlc.arg('reserve')::boolean
               AND (sqlc.arg('max_reserved')::double precision < 0 OR -d.low <= sqlc.arg('max_reserved')::double precision) AS reserved
    FROM (
        SELECT f.*, CASE f.charge2 WHEN 1 THEN f.end_a WHEN 2 THEN f.end_b ELSE least(f.end_a, f.end_b) END AS low
        FROM (
            SELECT e.*, txlimit_left(0, e.charge2, e.lv_a, e.lv_b, sqlc.arg('count')::double precision) AS end_a,
                   txlimit_left(1, e.charge2, e.lv_a, e.lv_b, sqlc.arg('count')::double precision) AS end_b
            FROM (
                SELECT v.*, txlimit_charge(v.lv_a, v.lv_b, v.two, sqlc.arg('count')::double precision, v.charge) AS charge2
                FROM ev v
                OFFSET 0
            ) e
            OFFSET 0
        ) f
        OFFSET 0
    ) d
),
-- What to write: only when locking, granted, and no charged row vanished meanwhile.
w AS MATERIALIZED (
    SELECT p.*,
           p.locking AND (p.ok_now OR p.reserved) AND NOT (p.charge = 3 AND p.vanished) AS write,
           p.charge2 IN (1, 3) AS write_a, p.charge2 IN (2, 3) AS write_b
    FROM plan p
),
-- Full rows that evaluate exactly as missing ones (see Decide), in shard order.
fill AS (
    INSERT INTO txlimit_state (name, key, shard, value, ts)
    SELECT sqlc.arg('name')::text, sqlc.arg('key')::text, m.shard, sqlc.arg('cap')::double precision,
           'epoch'::timestamptz + (CASE WHEN sqlc.arg('kind')::smallint = 0 THEN 0 ELSE sqlc.arg('anchor_us')::bigint END)
                                  * interval '1 microsecond'
    FROM p0 p
    CROSS JOIN LATERAL (VALUES (p.sa, p.a_missing), (p.sb, p.b_missing)) AS m(shard, missing)
    WHERE p.prefill AND m.missing
    ORDER BY m.shard
    ON CONFLICT DO NOTHING
    RETURNING 1
),
-- A single charged row that is missing is inserted with its new value.
ins AS (
    INSERT INTO txlimit_state (name, key, shard, value, ts)
    SELECT sqlc.arg('name')::text, sqlc.arg('key')::text,
           CASE WHEN w.write_a THEN w.sa ELSE w.sb END,
           CASE WHEN w.write_a THEN w.end_a ELSE w.end_b END,
           'epoch'::timestamptz + (CASE WHEN w.write_a THEN w.ts_a ELSE w.ts_b END) * interval '1 microsecond'
    FROM w
    WHERE w.write AND w.charge2 <> 3 AND (CASE WHEN w.write_a THEN w.va ELSE w.vb END) IS NULL
    ON CONFLICT DO NOTHING
    RETURNING 1
),
-- Each charged shard is updated through its whole primary key: a unique index probe, with the shard
-- given by a scalar subquery so that it is part of the index condition. (Joined on w.sa instead,
-- the plan scans every shard of the key and filters; and a scan over several shards, e.g.
-- shard = ANY(...), becomes a bitmap heap scan. Either way a SERIALIZABLE transaction then reads
-- more than two tuples of a heap page, its predicate locks are promoted to the whole page, and so
-- every shard of the key.)
upd_a AS (
    UPDATE txlimit_state s
    SET value = w.end_a, ts = 'epoch'::timestamptz + w.ts_a * interval '1 microsecond'
    FROM w
    WHERE w.write AND w.write_a AND w.va IS NOT NULL
      AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text
      AND s.shard = (SELECT x.sa FROM w x WHERE x.write AND x.write_a AND x.va IS NOT NULL)
    RETURNING 1
),
upd_b AS (
    UPDATE txlimit_state s
    SET value = w.end_b, ts = 'epoch'::timestamptz + w.ts_b * interval '1 microsecond'
    FROM w
    WHERE w.write AND w.write_b AND w.vb IS NOT NULL
      AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text
      AND s.shard = (SELECT x.sb FROM w x WHERE x.write AND x.write_b AND x.vb IS NOT NULL)
    RETURNING 1
)
SELECT CASE WHEN w.busy THEN 4
            WHEN w.prefill OR (w.locking AND w.charge = 3 AND w.vanished) THEN 3
            WHEN NOT w.locking THEN 2
            WHEN NOT (w.ok_now OR w.reserved) THEN 1
            WHEN (SELECT count(*) FROM ins) + (SELECT count(*) FROM upd_a) + (SELECT count(*) FROM upd_b) = 0 THEN 3
            ELSE 0
       END::integer AS status,
       w.charge2::integer AS charge,
       w.sa::integer AS shard_a,
       w.sb::integer AS shard_b,
       w.ok_now::boolean AS ok_now,
       w.reserved::boolean AS reserved,
       w.lv_a::double precision AS level_a,
       w.lv_b::double precision AS level_b,
       w.end_a::double precision AS end_a,
       w.end_b::double precision AS end_b,
       w.ts_a::bigint AS ts_a_us,
       w.ts_b::bigint AS ts_b_us,
       w.now_us::bigint AS now_us
FROM w;
