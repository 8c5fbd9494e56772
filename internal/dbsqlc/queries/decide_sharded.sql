-- name: DecideSharded :one
-- DecideSharded is Decide for one request on a sharded limit, with its two candidate shards
-- (shard_a, shard_b). It follows Decide's steps with a fraction of the work (no arrays, no joins
-- between requests): a lock-free read and a plan on it; a denial there is answered without a lock
-- or a write; otherwise only the rows to be charged are locked (in shard order), the plan is
-- re-decided on their latest versions, and they are updated, or inserted ON CONFLICT DO NOTHING
-- when a single charged row is missing. When both rows are charged and some are missing, it only
-- creates them full and asks for a re-run, as Decide does. Statuses are Decide's: 0 granted and
-- written, 1 denied after the lock, 2 decided without a lock (dry run or fast denial), 3 re-run
-- needed.
WITH clock AS MATERIALIZED (
    SELECT (extract(epoch FROM coalesce(sqlc.narg('now')::timestamptz, clock_timestamp())) * 1000000)::bigint AS now_us
),
-- Per-row primary-key probes (see Decide: no sequential scan, no relation-level predicate lock).
snap_a AS MATERIALIZED (
    SELECT 0 AS slot, sqlc.arg('shard_a')::integer AS shard, s.value, s.ts_us
    FROM clock k
    LEFT JOIN LATERAL (
        SELECT st.value, (extract(epoch FROM st.ts) * 1000000)::bigint AS ts_us
        FROM txlimit_state st
        WHERE st.name = sqlc.arg('name')::text AND st.key = sqlc.arg('key')::text AND st.shard = sqlc.arg('shard_a')::integer
        LIMIT 1
    ) s ON true
),
-- The second pick. Under REPEATABLE READ or SERIALIZABLE a row that is read but not charged makes
-- this transaction a reader of whoever charges it, and with many callers such read/write
-- dependencies form cycles that SERIALIZABLE aborts; there, the second shard is read only when
-- the first cannot serve the request alone. Under READ COMMITTED reads cost nothing, and both are
-- always read (power-of-two choice).
snap AS MATERIALIZED (
    SELECT a.slot, a.shard, a.value, a.ts_us FROM snap_a a
    UNION ALL
    SELECT 1, sqlc.arg('shard_b')::integer, s.value, s.ts_us
    FROM snap_a a
    CROSS JOIN clock k
    LEFT JOIN LATERAL (
        SELECT st.value, (extract(epoch FROM st.ts) * 1000000)::bigint AS ts_us
        FROM txlimit_state st
        WHERE st.name = sqlc.arg('name')::text AND st.key = sqlc.arg('key')::text AND st.shard = sqlc.arg('shard_b')::integer
        LIMIT 1
    ) s ON true
    WHERE current_setting('transaction_isolation') NOT IN ('serializable', 'repeatable read')
       OR CASE WHEN a.value IS NULL THEN sqlc.arg('cap')::double precision
               ELSE txlimit_level(sqlc.arg('kind')::smallint, a.value, a.ts_us, k.now_us, sqlc.arg('rate')::double precision,
                                  sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision)
          END < sqlc.arg('count')::double precision
),
ev0 AS MATERIALIZED (
    SELECT sn.slot, sn.shard, sn.value IS NOT NULL AS existed,
           CASE WHEN sn.value IS NULL THEN sqlc.arg('cap')::double precision
                ELSE txlimit_level(sqlc.arg('kind')::smallint, sn.value, sn.ts_us, k.now_us, sqlc.arg('rate')::double precision,
                                   sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision)
           END AS lv
    FROM snap sn CROSS JOIN clock k
),
plan0 AS MATERIALIZED (
    SELECT x.charge,
           x.low >= 0 OR (sqlc.arg('reserve')::boolean AND (sqlc.arg('max_reserved')::double precision < 0
                                                            OR -x.low <= sqlc.arg('max_reserved')::double precision)) AS granted
    FROM (
        SELECT c.charge,
               CASE WHEN c.charge = 3 THEN least(txlimit_left(0, 3, c.lv_a, c.lv_b, sqlc.arg('count')::double precision),
                                                 txlimit_left(1, 3, c.lv_a, c.lv_b, sqlc.arg('count')::double precision))
                    ELSE txlimit_left(c.charge - 1, c.charge, c.lv_a, c.lv_b, sqlc.arg('count')::double precision)
               END AS low
        FROM (
            SELECT l.lv_a, l.lv_b,
                   txlimit_charge(l.lv_a, l.lv_b, l.two, sqlc.arg('count')::double precision, 0) AS charge
            FROM (
                SELECT max(e.lv) FILTER (WHERE e.slot = 0) AS lv_a,
                       coalesce(max(e.lv) FILTER (WHERE e.slot = 1), 0) AS lv_b,
                       count(*) = 2 AS two
                FROM ev0 e
            ) l
        ) c
    ) x
),
lockset AS MATERIALIZED (
    SELECT e.slot, e.shard, e.existed
    FROM ev0 e CROSS JOIN plan0 p
    WHERE (e.slot = 0 AND p.charge IN (1, 3)) OR (e.slot = 1 AND p.charge IN (2, 3))
),
gate AS MATERIALIZED (
    SELECT NOT sqlc.arg('dry')::boolean AND p.granted AND (l.rows = 1 OR l.missing = 0) AS locking,
           NOT sqlc.arg('dry')::boolean AND p.granted AND l.rows > 1 AND l.missing > 0 AS prefill
    FROM plan0 p
    CROSS JOIN (SELECT count(*) AS rows, count(*) FILTER (WHERE NOT existed) AS missing FROM lockset) l
),
-- The charged rows are locked one probe at a time, in shard order.
lk AS MATERIALIZED (
    SELECT o.slot, l.value, (extract(epoch FROM l.ts) * 1000000)::bigint AS ts_us
    FROM (SELECT ls.slot, ls.shard FROM lockset ls WHERE (SELECT locking FROM gate) ORDER BY ls.shard) o
    CROSS JOIN LATERAL (
        SELECT st.value, st.ts
        FROM txlimit_state st
        WHERE st.name = sqlc.arg('name')::text AND st.key = sqlc.arg('key')::text AND st.shard = o.shard
        FOR UPDATE
    ) l
),
cur AS MATERIALIZED (
    SELECT sn.slot, sn.shard,
           CASE WHEN ls.slot IS NOT NULL AND g.locking THEN l.value ELSE sn.value END AS value,
           CASE WHEN ls.slot IS NOT NULL AND g.locking THEN l.ts_us ELSE sn.ts_us END AS ts_us,
           ls.slot IS NOT NULL AND g.locking AND sn.value IS NOT NULL AND l.value IS NULL AS vanished
    FROM snap sn
    CROSS JOIN gate g
    LEFT JOIN lockset ls ON ls.slot = sn.slot
    LEFT JOIN lk l ON l.slot = sn.slot
),
ev AS MATERIALIZED (
    SELECT cu.slot, cu.shard, cu.value IS NOT NULL AS existed, cu.vanished,
           CASE WHEN cu.value IS NULL THEN sqlc.arg('cap')::double precision
                ELSE txlimit_level(sqlc.arg('kind')::smallint, cu.value, cu.ts_us, k.now_us, sqlc.arg('rate')::double precision,
                                   sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision)
           END AS lv,
           CASE WHEN cu.value IS NOT NULL THEN txlimit_next_ts(sqlc.arg('kind')::smallint, cu.ts_us, k.now_us, sqlc.arg('period_us')::bigint)
                WHEN sqlc.arg('kind')::smallint = 0 THEN k.now_us
                ELSE k.now_us - ((k.now_us - sqlc.arg('anchor_us')::bigint) % sqlc.arg('period_us')::bigint
                                 + sqlc.arg('period_us')::bigint) % sqlc.arg('period_us')::bigint
           END AS ts_us
    FROM cur cu CROSS JOIN clock k
),
plan AS MATERIALIZED (
    SELECT d.*,
           d.low >= 0 AS ok_now,
           d.low < 0 AND sqlc.arg('reserve')::boolean
               AND (sqlc.arg('max_reserved')::double precision < 0 OR -d.low <= sqlc.arg('max_reserved')::double precision) AS reserved
    FROM (
        SELECT c.*, CASE c.charge WHEN 1 THEN c.end_a WHEN 2 THEN c.end_b ELSE least(c.end_a, c.end_b) END AS low
        FROM (
            SELECT b.*, txlimit_left(0, b.charge, b.lv_a, b.lv_b, sqlc.arg('count')::double precision) AS end_a,
                   txlimit_left(1, b.charge, b.lv_a, b.lv_b, sqlc.arg('count')::double precision) AS end_b
            FROM (
                SELECT l.*, txlimit_charge(l.lv_a, l.lv_b, l.two, sqlc.arg('count')::double precision, p0.charge) AS charge
                FROM (
                    SELECT max(e.lv) FILTER (WHERE e.slot = 0) AS lv_a,
                           coalesce(max(e.lv) FILTER (WHERE e.slot = 1), 0) AS lv_b,
                           max(e.ts_us) FILTER (WHERE e.slot = 0) AS ts_a,
                           coalesce(max(e.ts_us) FILTER (WHERE e.slot = 1), 0) AS ts_b,
                           count(*) = 2 AS two,
                           bool_or(e.vanished) AS vanished
                    FROM ev e
                ) l CROSS JOIN plan0 p0
            ) b
        ) c
    ) d
),
w AS MATERIALIZED (
    SELECT e.slot, e.shard, e.existed, e.ts_us, CASE WHEN e.slot = 0 THEN p.end_a ELSE p.end_b END AS value
    FROM plan p
    JOIN ev e ON (e.slot = 0 AND p.charge IN (1, 3)) OR (e.slot = 1 AND p.charge IN (2, 3))
    WHERE (SELECT locking FROM gate) AND (p.ok_now OR p.reserved) AND NOT (p.two AND p.vanished)
),
-- Full rows that evaluate exactly as missing ones (see Decide).
fill AS (
    INSERT INTO txlimit_state (name, key, shard, value, ts)
    SELECT sqlc.arg('name')::text, sqlc.arg('key')::text, ls.shard, sqlc.arg('cap')::double precision,
           'epoch'::timestamptz + (CASE WHEN sqlc.arg('kind')::smallint = 0 THEN 0 ELSE sqlc.arg('anchor_us')::bigint END)
                                  * interval '1 microsecond'
    FROM lockset ls
    WHERE NOT ls.existed AND (SELECT prefill FROM gate)
    ORDER BY ls.shard
    ON CONFLICT DO NOTHING
    RETURNING 1
),
ins AS (
    INSERT INTO txlimit_state (name, key, shard, value, ts)
    SELECT sqlc.arg('name')::text, sqlc.arg('key')::text, w.shard, w.value,
           'epoch'::timestamptz + w.ts_us * interval '1 microsecond'
    FROM w
    WHERE NOT w.existed
    ON CONFLICT DO NOTHING
    RETURNING 1
),
-- Each charged shard is updated through its whole primary key: a unique index probe. (A scan over
-- several shards, e.g. shard = ANY(...), becomes a bitmap heap scan, whose SERIALIZABLE predicate
-- lock covers the whole heap page, and so every shard of the key.)
upd_a AS (
    UPDATE txlimit_state s
    SET value = w.value, ts = 'epoch'::timestamptz + w.ts_us * interval '1 microsecond'
    FROM w
    WHERE w.slot = 0 AND w.existed
      AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = sqlc.arg('shard_a')::integer
      AND (SELECT count(*) FROM ins) = (SELECT count(*) FROM w WHERE NOT w.existed)
    RETURNING 1
),
upd_b AS (
    UPDATE txlimit_state s
    SET value = w.value, ts = 'epoch'::timestamptz + w.ts_us * interval '1 microsecond'
    FROM w
    WHERE w.slot = 1 AND w.existed
      AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = sqlc.arg('shard_b')::integer
      AND (SELECT count(*) FROM ins) = (SELECT count(*) FROM w WHERE NOT w.existed)
    RETURNING 1
)
SELECT CASE WHEN g.prefill OR (p.two AND p.vanished AND g.locking) THEN 3
            WHEN NOT g.locking THEN 2
            WHEN NOT (p.ok_now OR p.reserved) THEN 1
            WHEN (SELECT count(*) FROM ins) < (SELECT count(*) FROM w WHERE NOT w.existed)
                 OR (SELECT count(*) FROM ins) + (SELECT count(*) FROM upd_a) + (SELECT count(*) FROM upd_b) = 0 THEN 3
            ELSE 0
       END::integer AS status,
       p.charge::integer AS charge,
       p.ok_now::boolean AS ok_now,
       p.reserved::boolean AS reserved,
       p.lv_a::double precision AS level_a,
       p.lv_b::double precision AS level_b,
       p.end_a::double precision AS end_a,
       p.end_b::double precision AS end_b,
       p.ts_a::bigint AS ts_a_us,
       p.ts_b::bigint AS ts_b_us,
       (SELECT now_us FROM clock)::bigint AS now_us
FROM plan p CROSS JOIN gate g;
