-- name: Decide :many
-- Decide takes one or more limit requests (parallel arrays, one element per request) and decides
-- them together, all-or-nothing, in one statement. It is exact under READ COMMITTED and
-- SERIALIZABLE alike:
--   1. snap: a lock-free read of every candidate row (1 shard, or 2 for a sharded limit).
--   2. gate: if that read already shows some request cannot be granted (or this is a dry run),
--      decide on it and stop: no row lock, no write. Rows only lose tokens except through a credit
--      or reset, so this can under-grant against a concurrent credit but never over-grant.
--   3. lk: otherwise lock the existing candidate rows in one global order (name, key, shard) and
--      decide on their latest versions (FOR UPDATE re-reads them after any wait).
--   4. Write only when every request is granted, by updating the locked rows. A single-row call
--      whose row is missing inserts it ON CONFLICT DO NOTHING instead; if a concurrent caller
--      created it meanwhile, nothing is written and the status asks for a re-run (status 3).
--   5. A call that involves two or more rows, some of them missing, locks nothing: it only
--      creates the missing rows full (evaluating exactly as missing), in the global order, and asks for a
--      re-run (status 3). Locking existing rows and then inserting others would break the global
--      lock order across concurrent calls (and deadlock); this way every multi-row decision locks
--      rows that all exist, in one order, and no race can leave part of it written.
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
shape AS MATERIALIZED (
    SELECT count(*) AS rows, count(*) FILTER (WHERE sn.value IS NULL) AS missing FROM snap sn
),
gate AS MATERIALIZED (
    SELECT NOT sqlc.arg('dry')::boolean AND coalesce(bool_and(p.possible), false)
               AND ((SELECT rows FROM shape) = 1 OR (SELECT missing FROM shape) = 0) AS locking,
           NOT sqlc.arg('dry')::boolean AND coalesce(bool_and(p.possible), false)
               AND (SELECT rows FROM shape) > 1 AND (SELECT missing FROM shape) > 0 AS prefill
    FROM (
        SELECT r.idx,
               max(l.lv) >= r.count
               OR sum(l.lv) >= r.count
               OR (r.reserve AND (r.max_reserved < 0
                                  OR max(l.lv) - r.count >= -r.max_reserved
                                  OR (count(*) = 2 AND sum(l.lv) - r.count >= -2 * r.max_reserved))) AS possible
        FROM req r
        JOIN (
            SELECT sn.idx,
                   CASE WHEN sn.value IS NULL THEN rq.cap
                        ELSE txlimit_level(rq.kind, sn.value, sn.ts_us, k.now_us, rq.rate, rq.period_us, rq.cap)
                   END AS lv
            FROM snap sn JOIN req rq ON rq.idx = sn.idx CROSS JOIN clock k
        ) l ON l.idx = r.idx
        GROUP BY r.idx, r.count, r.reserve, r.max_reserved
    ) p
),
-- The rows are locked one probe at a time, driven by the candidates in the global order.
lk AS MATERIALIZED (
    SELECT l.name, l.key, l.shard, l.value, l.ts
    FROM (
        SELECT DISTINCT c.name, c.key, c.shard FROM cand c
        WHERE (SELECT locking FROM gate)
        ORDER BY c.name, c.key, c.shard
    ) o
    CROSS JOIN LATERAL (
        SELECT st.name, st.key, st.shard, st.value, st.ts
        FROM txlimit_state st
        WHERE st.name = o.name AND st.key = o.key AND st.shard = o.shard
        FOR UPDATE
    ) l
),
cur AS MATERIALIZED (
    SELECT sn.idx, sn.slot, sn.name, sn.key, sn.shard,
           CASE WHEN g.locking THEN l.value ELSE sn.value END AS value,
           CASE WHEN g.locking THEN (extract(epoch FROM l.ts) * 1000000)::bigint ELSE sn.ts_us END AS ts_us,
           g.locking AND sn.value IS NOT NULL AND l.value IS NULL AS vanished
    FROM snap sn
    CROSS JOIN gate g
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
choice AS MATERIALIZED (
    SELECT r.idx, r.count, r.reserve, r.max_reserved,
           a.lv AS lv_a, coalesce(b.lv, 0) AS lv_b, b.idx IS NOT NULL AS two,
           CASE WHEN b.idx IS NULL THEN 1
                WHEN greatest(a.lv, b.lv) >= r.count THEN CASE WHEN a.lv >= b.lv THEN 1 ELSE 2 END
                WHEN abs(a.lv - b.lv) <= r.count THEN 3
                ELSE CASE WHEN a.lv >= b.lv THEN 1 ELSE 2 END
           END AS charge
    FROM req r
    JOIN ev a ON a.idx = r.idx AND a.slot = 0
    LEFT JOIN ev b ON b.idx = r.idx AND b.slot = 1
),
plan AS MATERIALIZED (
    SELECT e.idx, e.charge, e.end_a, e.end_b,
           e.low >= 0 AS ok_now,
           e.low < 0 AND e.reserve AND (e.max_reserved < 0 OR -e.low <= e.max_reserved) AS reserved
    FROM (
        SELECT c.*,
               CASE WHEN c.charge = 2 THEN c.end_b WHEN c.charge = 1 THEN c.end_a ELSE least(c.end_a, c.end_b) END AS low
        FROM (
            SELECT ch.*,
                   CASE ch.charge WHEN 1 THEN ch.lv_a - ch.count
                                  WHEN 3 THEN (ch.lv_a + ch.lv_b - ch.count) / 2
                                  ELSE ch.lv_a END AS end_a,
                   CASE ch.charge WHEN 2 THEN ch.lv_b - ch.count
                                  WHEN 3 THEN (ch.lv_a + ch.lv_b - ch.count) / 2
                                  ELSE ch.lv_b END AS end_b
            FROM choice ch
        ) c
    ) e
),
verdict AS MATERIALIZED (
    SELECT g.locking, g.prefill, coalesce(bool_and(p.ok_now OR p.reserved), false) AS granted,
           (SELECT rows FROM shape) > 1 AND EXISTS (SELECT 1 FROM cur WHERE cur.vanished) AS vanished
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
    SELECT sn.name, sn.key, sn.shard, r.cap,
           'epoch'::timestamptz + (CASE WHEN r.kind = 0 THEN 0 ELSE r.anchor_us END) * interval '1 microsecond'
    FROM snap sn
    JOIN req r ON r.idx = sn.idx
    WHERE sn.value IS NULL AND (SELECT prefill FROM gate)
    ORDER BY sn.name, sn.key, sn.shard
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
       ch.lv_a::double precision AS level_a,
       ch.lv_b::double precision AS level_b,
       p.end_a::double precision AS end_a,
       p.end_b::double precision AS end_b,
       ea.ts_us::bigint AS ts_a_us,
       coalesce(eb.ts_us, 0)::bigint AS ts_b_us,
       k.now_us::bigint AS now_us
FROM plan p
JOIN choice ch ON ch.idx = p.idx
JOIN ev ea ON ea.idx = p.idx AND ea.slot = 0
LEFT JOIN ev eb ON eb.idx = p.idx AND eb.slot = 1
CROSS JOIN outcome o
CROSS JOIN clock k
ORDER BY p.idx;
