-- name: Decide :many
-- Decide takes one or more limit requests (parallel arrays, one element per request) and decides
-- them together, all-or-nothing, in one statement. It is exact under READ COMMITTED and
-- SERIALIZABLE alike:
--   1. snap: a lock-free read of every candidate row (1 shard, or 2 for a sharded limit), and a
--      plan on it (txlimit_charge, txlimit_left): which rows each request would charge, and whether
--      all are granted.
--   2. If some request is denied on that read (or this is a dry run), answer from it: no lock, no
--      write. Rows only gain tokens through a credit or reset, so this can under-grant against a
--      concurrent credit but never over-grant.
--   3. Otherwise lock only the rows to be charged, in one global order (name, key, shard), with
--      FOR UPDATE, which re-reads their latest committed versions under READ COMMITTED (and raises
--      a serialization failure under REPEATABLE READ or SERIALIZABLE if they changed). Decide again
--      on those latest levels, keeping the chosen rows, and write only if every request is still
--      granted. A candidate that is not charged is neither locked nor written: under SERIALIZABLE it
--      is only read, so callers on other shards do not fail each other; under READ COMMITTED a
--      race can only turn a grant into a denial.
--   4. A single-row write whose row is missing inserts it ON CONFLICT DO NOTHING; if a concurrent
--      caller created it meanwhile, nothing is written and the status asks for a re-run (status 3).
--   5. A decision that would lock two or more rows, some of them missing, locks nothing: it only
--      creates the missing ones full (evaluating exactly as missing), in the global order, and asks
--      for a re-run (status 3). Locking existing rows and then inserting others would break the
--      global lock order across concurrent calls (and deadlock); this way every multi-row decision
--      locks rows that all exist, in one order, and no race can leave part of it written.
-- Nested subqueries end in OFFSET 0 so that the planner does not flatten them: flattened, every
-- use of a computed column would re-expand the inlined txlimit_* expressions that define it.
-- Status: 0 granted and written, 1 denied, 2 decided without writing (dry run or fast denial),
-- 3 re-run needed.
WITH clock AS MATERIALIZED (
    SELECT (extract(epoch FROM coalesce(sqlc.narg('now')::timestamptz, clock_timestamp())) * 1000000)::bigint AS now_us
),
req AS MATERIALIZED (
    SELECT i::bigint AS idx,
           name,
           (sqlc.arg('keys')::text[])[i] AS key,
           (sqlc.arg('counts')::double precision[])[i] AS count,
           (sqlc.arg('kinds')::smallint[])[i] AS kind,
           (sqlc.arg('rates')::double precision[])[i] AS rate,
           (sqlc.arg('periods_us')::bigint[])[i] AS period_us,
           (sqlc.arg('caps')::double precision[])[i] AS cap,
           (sqlc.arg('max_reserved')::double precision[])[i] AS max_reserved,
           (sqlc.arg('reserves')::boolean[])[i] AS reserve,
           (sqlc.arg('anchors_us')::bigint[])[i] AS anchor_us,
           (sqlc.arg('shards_a')::integer[])[i] AS shard_a,
           (sqlc.arg('shards_b')::integer[])[i] AS shard_b
    -- unnest's row estimate is small (10), so the planner looks rows up by primary key.
    FROM unnest(sqlc.arg('names')::text[]) WITH ORDINALITY AS n(name, i)
),
cand AS MATERIALIZED (
    SELECT req.idx, 0 AS slot, req.name, req.key, req.shard_a AS shard FROM req
    UNION ALL
    SELECT req.idx, 1 AS slot, req.name, req.key, req.shard_b AS shard FROM req WHERE req.shard_b >= 0
),
-- Every access to txlimit_state is a per-row primary-key probe (LATERAL … LIMIT 1 cannot be
-- flattened into a hash join over a sequential scan). Under SERIALIZABLE a sequential scan would
-- take a relation-level predicate lock and make every decision conflict with every other.
snap AS MATERIALIZED (
    SELECT c.idx, c.slot, c.name, c.key, c.shard, s.value, s.ts_us
    FROM cand c
    LEFT JOIN LATERAL (
        SELECT st.value, (extract(epoch FROM st.ts) * 1000000)::bigint AS ts_us
        FROM txlimit_state st
        WHERE st.name = c.name AND st.key = c.key AND st.shard = c.shard
        LIMIT 1
    ) s ON true
),
-- Levels on the lock-free read, and the plan they give.
ev0 AS MATERIALIZED (
    SELECT sn.idx, sn.slot, sn.name, sn.key, sn.shard, sn.value IS NOT NULL AS existed,
           CASE WHEN sn.value IS NULL THEN r.cap
                ELSE txlimit_level(r.kind, sn.value, sn.ts_us, k.now_us, r.rate, r.period_us, r.cap)
           END AS lv
    FROM snap sn JOIN req r ON r.idx = sn.idx CROSS JOIN clock k
),
plan0 AS MATERIALIZED (
    SELECT x.idx, x.charge,
           x.low >= 0 OR (x.reserve AND (x.max_reserved < 0 OR -x.low <= x.max_reserved)) AS granted
    FROM (
        SELECT c.idx, c.charge, c.reserve, c.max_reserved,
               CASE WHEN c.charge = 3 THEN least(txlimit_left(0, 3, c.lv_a, c.lv_b, c.count), txlimit_left(1, 3, c.lv_a, c.lv_b, c.count))
                    ELSE txlimit_left(c.charge - 1, c.charge, c.lv_a, c.lv_b, c.count)
               END AS low
        FROM (
            SELECT r.idx, r.count, r.reserve, r.max_reserved, a.lv AS lv_a, coalesce(b.lv, 0) AS lv_b,
                   txlimit_charge(a.lv, coalesce(b.lv, 0), b.idx IS NOT NULL, r.count, 0) AS charge
            FROM req r
            JOIN ev0 a ON a.idx = r.idx AND a.slot = 0
            LEFT JOIN ev0 b ON b.idx = r.idx AND b.slot = 1
            OFFSET 0
        ) c
    ) x
),
-- The rows the plan charges: the only rows locked and written.
lockset AS MATERIALIZED (
    SELECT e.name, e.key, e.shard, e.existed
    FROM plan0 p
    JOIN ev0 e ON e.idx = p.idx
             AND ((e.slot = 0 AND p.charge IN (1, 3)) OR (e.slot = 1 AND p.charge IN (2, 3)))
),
gate AS MATERIALIZED (
    SELECT NOT sqlc.arg('dry')::boolean AND g.granted AND (l.rows = 1 OR l.missing = 0) AS locking,
           NOT sqlc.arg('dry')::boolean AND g.granted AND l.rows > 1 AND l.missing > 0 AS prefill
    FROM (SELECT coalesce(bool_and(granted), false) AS granted FROM plan0) g
    CROSS JOIN (SELECT count(*) AS rows, count(*) FILTER (WHERE NOT existed) AS missing FROM lockset) l
),
-- The rows are locked one probe at a time, in the global order.
lk AS MATERIALIZED (
    SELECT l.name, l.key, l.shard, l.value, l.ts
    FROM (
        SELECT DISTINCT ls.name, ls.key, ls.shard FROM lockset ls
        WHERE (SELECT locking FROM gate)
        ORDER BY ls.name, ls.key, ls.shard
    ) o
    CROSS JOIN LATERAL (
        SELECT st.name, st.key, st.shard, st.value, st.ts
        FROM txlimit_state st
        WHERE st.name = o.name AND st.key = o.key AND st.shard = o.shard
        FOR UPDATE
    ) l
),
-- Each candidate as decided on: a locked row's latest version, else the lock-free read.
cur AS MATERIALIZED (
    SELECT sn.idx, sn.slot, sn.name, sn.key, sn.shard,
           CASE WHEN ls.name IS NOT NULL AND g.locking THEN l.value ELSE sn.value END AS value,
           CASE WHEN ls.name IS NOT NULL AND g.locking THEN (extract(epoch FROM l.ts) * 1000000)::bigint
                ELSE sn.ts_us END AS ts_us,
           ls.name IS NOT NULL AND g.locking AND sn.value IS NOT NULL AND l.value IS NULL AS vanished
    FROM snap sn
    CROSS JOIN gate g
    LEFT JOIN lockset ls ON ls.name = sn.name AND ls.key = sn.key AND ls.shard = sn.shard
    LEFT JOIN lk l ON l.name = sn.name AND l.key = sn.key AND l.shard = sn.shard
),
ev AS MATERIALIZED (
    SELECT cu.idx, cu.slot, cu.name, cu.key, cu.shard, cu.value IS NOT NULL AS existed,
           CASE WHEN cu.value IS NULL THEN r.cap
                ELSE txlimit_level(r.kind, cu.value, cu.ts_us, k.now_us, r.rate, r.period_us, r.cap)
           END AS lv,
           CASE WHEN cu.value IS NOT NULL THEN txlimit_next_ts(r.kind, cu.ts_us, k.now_us, r.period_us)
                WHEN r.kind = 0 THEN k.now_us
                ELSE k.now_us - ((k.now_us - r.anchor_us) % r.period_us + r.period_us) % r.period_us
           END AS ts_us
    FROM cur cu JOIN req r ON r.idx = cu.idx CROSS JOIN clock k
),
-- The decision on the latest levels of the locked rows, charging the rows chosen above.
plan AS MATERIALIZED (
    SELECT e.idx, e.lv_a, e.lv_b, e.charge, e.end_a, e.end_b,
           e.low >= 0 AS ok_now,
           e.low < 0 AND e.reserve AND (e.max_reserved < 0 OR -e.low <= e.max_reserved) AS reserved
    FROM (
        SELECT d.*, CASE d.charge WHEN 1 THEN d.end_a WHEN 2 THEN d.end_b ELSE least(d.end_a, d.end_b) END AS low
        FROM (
            SELECT c.*, txlimit_left(0, c.charge, c.lv_a, c.lv_b, c.count) AS end_a,
                   txlimit_left(1, c.charge, c.lv_a, c.lv_b, c.count) AS end_b
            FROM (
                SELECT r.idx, r.count, r.reserve, r.max_reserved, a.lv AS lv_a, coalesce(b.lv, 0) AS lv_b,
                       txlimit_charge(a.lv, coalesce(b.lv, 0), b.idx IS NOT NULL, r.count, p0.charge) AS charge
                FROM req r
                JOIN plan0 p0 ON p0.idx = r.idx
                JOIN ev a ON a.idx = r.idx AND a.slot = 0
                LEFT JOIN ev b ON b.idx = r.idx AND b.slot = 1
                OFFSET 0
            ) c
        ) d
        OFFSET 0
    ) e
),
verdict AS MATERIALIZED (
    SELECT g.locking, g.prefill, coalesce(bool_and(p.ok_now OR p.reserved), false) AS granted,
           (SELECT count(*) FROM lockset) > 1 AND EXISTS (SELECT 1 FROM cur WHERE cur.vanished) AS vanished
    FROM gate g CROSS JOIN plan p
    GROUP BY g.locking, g.prefill
),
w AS MATERIALIZED (
    SELECT e.name, e.key, e.shard, e.existed, e.ts_us,
           CASE WHEN e.slot = 0 THEN p.end_a ELSE p.end_b END AS value
    FROM plan p
    JOIN ev e ON e.idx = p.idx
             AND ((e.slot = 0 AND p.charge IN (1, 3)) OR (e.slot = 1 AND p.charge IN (2, 3)))
    WHERE (SELECT locking AND granted AND NOT vanished FROM verdict)
),
-- A full row stamped at the epoch (token bucket) or at the grid's anchor (fixed window) evaluates
-- exactly like a missing row at any later instant: it holds cap, and ts' is now or the start of
-- the current window.
fill AS (
    INSERT INTO txlimit_state (name, key, shard, value, ts)
    SELECT ls.name, ls.key, ls.shard, r.cap,
           'epoch'::timestamptz + (CASE WHEN r.kind = 0 THEN 0 ELSE r.anchor_us END) * interval '1 microsecond'
    FROM lockset ls
    JOIN req r ON r.name = ls.name AND r.key = ls.key
    WHERE NOT ls.existed AND (SELECT prefill FROM gate)
    ORDER BY ls.name, ls.key, ls.shard
    ON CONFLICT DO NOTHING
    RETURNING 1
),
ins AS (
    INSERT INTO txlimit_state (name, key, shard, value, ts)
    SELECT w.name, w.key, w.shard, w.value, 'epoch'::timestamptz + w.ts_us * interval '1 microsecond'
    FROM w
    WHERE NOT w.existed
    ON CONFLICT DO NOTHING
    RETURNING 1
),
upd AS (
    UPDATE txlimit_state s
    SET value = w.value, ts = 'epoch'::timestamptz + w.ts_us * interval '1 microsecond'
    FROM w
    WHERE w.existed AND s.name = w.name AND s.key = w.key AND s.shard = w.shard
      AND (SELECT count(*) FROM ins) = (SELECT count(*) FROM w WHERE NOT w.existed)
    RETURNING 1
),
outcome AS (
    SELECT CASE WHEN v.prefill OR v.vanished THEN 3
                WHEN NOT v.locking THEN 2
                WHEN NOT v.granted THEN 1
                WHEN (SELECT count(*) FROM ins) < (SELECT count(*) FROM w WHERE NOT w.existed) THEN 3
                ELSE 0
           END AS status,
           (SELECT count(*) FROM upd) + (SELECT count(*) FROM fill) AS written
    FROM verdict v
)
SELECT p.idx::bigint AS idx,
       o.status::integer AS status,
       p.charge::integer AS charge,
       p.ok_now::boolean AS ok_now,
       p.reserved::boolean AS reserved,
       p.lv_a::double precision AS level_a,
       p.lv_b::double precision AS level_b,
       p.end_a::double precision AS end_a,
       p.end_b::double precision AS end_b,
       ea.ts_us::bigint AS ts_a_us,
       coalesce(eb.ts_us, 0)::bigint AS ts_b_us,
       k.now_us::bigint AS now_us
FROM plan p
JOIN ev ea ON ea.idx = p.idx AND ea.slot = 0
LEFT JOIN ev eb ON eb.idx = p.idx AND eb.slot = 1
CROSS JOIN outcome o
CROSS JOIN clock k
ORDER BY p.idx;
