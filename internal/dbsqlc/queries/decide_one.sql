-- name: DecideOne :one
-- DecideOne is Decide for the most common call: one request on one row (an unsharded limit). It
-- follows the same steps with a third of the work: a lock-free read; a denial visible there is
-- answered without a lock or a write; otherwise the row is locked (FOR UPDATE re-reads its latest
-- version), decided on, and updated, or inserted ON CONFLICT DO NOTHING when it is missing. If a
-- concurrent caller created the missing row first, nothing is written and the status asks for a
-- re-run. The nested subquery ends in OFFSET 0 so that its level is computed once rather than
-- re-expanded into every expression that uses it. Statuses are Decide's: 0 granted and written, 1 denied after the lock, 2 decided without
-- a lock (dry run or fast denial), 3 re-run needed.
WITH clock AS MATERIALIZED (
    SELECT (extract(epoch FROM coalesce(sqlc.narg('now')::timestamptz, clock_timestamp())) * 1000000)::bigint AS now_us
),
snap AS MATERIALIZED (
    SELECT k.now_us, s.value, (extract(epoch FROM s.ts) * 1000000)::bigint AS ts_us
    FROM clock k
    LEFT JOIN txlimit_state s ON s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = 0
),
gate AS MATERIALIZED (
    SELECT NOT sqlc.arg('dry')::boolean
           AND (l.lv >= sqlc.arg('count')::double precision
                OR (sqlc.arg('reserve')::boolean
                    AND (sqlc.arg('max_reserved')::double precision < 0
                         OR l.lv - sqlc.arg('count')::double precision >= -sqlc.arg('max_reserved')::double precision))) AS locking
    FROM (
        SELECT CASE WHEN sn.value IS NULL THEN sqlc.arg('cap')::double precision
                    ELSE txlimit_level(sqlc.arg('kind')::smallint, sn.value, sn.ts_us, sn.now_us, sqlc.arg('rate')::double precision,
                                       sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision)
               END AS lv
        FROM snap sn
    ) l
),
lk AS MATERIALIZED (
    SELECT s.value, (extract(epoch FROM s.ts) * 1000000)::bigint AS ts_us
    FROM txlimit_state s
    WHERE (SELECT locking FROM gate)
      AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = 0
    FOR UPDATE
),
cur AS MATERIALIZED (
    SELECT sn.now_us, g.locking,
           CASE WHEN g.locking THEN l.value ELSE sn.value END AS value,
           CASE WHEN g.locking THEN l.ts_us ELSE sn.ts_us END AS ts_us
    FROM snap sn CROSS JOIN gate g LEFT JOIN lk l ON true
),
dec AS MATERIALIZED (
    SELECT e.*,
           e.lv - sqlc.arg('count')::double precision AS end_v,
           e.lv - sqlc.arg('count')::double precision >= 0 AS ok_now,
           e.lv - sqlc.arg('count')::double precision < 0 AND sqlc.arg('reserve')::boolean
               AND (sqlc.arg('max_reserved')::double precision < 0
                    OR -(e.lv - sqlc.arg('count')::double precision) <= sqlc.arg('max_reserved')::double precision) AS reserved
    FROM (
        SELECT c.locking, c.value IS NOT NULL AS existed, c.now_us,
               CASE WHEN c.value IS NULL THEN sqlc.arg('cap')::double precision
                    ELSE txlimit_level(sqlc.arg('kind')::smallint, c.value, c.ts_us, c.now_us, sqlc.arg('rate')::double precision,
                                       sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision)
               END AS lv,
               CASE WHEN c.value IS NOT NULL THEN txlimit_next_ts(sqlc.arg('kind')::smallint, c.ts_us, c.now_us, sqlc.arg('period_us')::bigint)
                    WHEN sqlc.arg('kind')::smallint = 0 THEN c.now_us
                    ELSE c.now_us - ((c.now_us - sqlc.arg('anchor_us')::bigint) % sqlc.arg('period_us')::bigint
                                     + sqlc.arg('period_us')::bigint) % sqlc.arg('period_us')::bigint
               END AS ts_us
        FROM cur c
        OFFSET 0
    ) e
),
ins AS (
    INSERT INTO txlimit_state (name, key, shard, value, ts)
    SELECT sqlc.arg('name')::text, sqlc.arg('key')::text, 0, d.end_v,
           'epoch'::timestamptz + d.ts_us * interval '1 microsecond'
    FROM dec d
    WHERE d.locking AND (d.ok_now OR d.reserved) AND NOT d.existed
    ON CONFLICT DO NOTHING
    RETURNING 1
),
upd AS (
    UPDATE txlimit_state s
    SET value = d.end_v, ts = 'epoch'::timestamptz + d.ts_us * interval '1 microsecond'
    FROM dec d
    WHERE d.locking AND (d.ok_now OR d.reserved) AND d.existed
      AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = 0
    RETURNING 1
)
SELECT CASE WHEN NOT d.locking THEN 2
            WHEN NOT (d.ok_now OR d.reserved) THEN 1
            WHEN (SELECT count(*) FROM ins) + (SELECT count(*) FROM upd) = 0 THEN 3
            ELSE 0
       END::integer AS status,
       d.ok_now::boolean AS ok_now,
       d.reserved::boolean AS reserved,
       d.lv::double precision AS level,
       d.end_v::double precision AS end_value,
       d.ts_us::bigint AS ts_us,
       d.now_us::bigint AS now_us
FROM dec d;
