-- name: Credit :many
-- Credit gives count tokens back to the shard rows 0..shards-1 of (name, key), never above cap (the
-- per-shard capacity). The rows are locked in shard order and the tokens go to the emptiest shards
-- first: each shard takes what the shards before it could not. Missing rows are full and take
-- nothing, so a credit never creates a row. Returns every existing shard row with its level before
-- and after.
WITH clock AS MATERIALIZED (
    SELECT (extract(epoch FROM coalesce(sqlc.narg('now')::timestamptz, clock_timestamp())) * 1000000)::bigint AS now_us
),
lk AS MATERIALIZED (
    SELECT s.shard, s.value, (extract(epoch FROM s.ts) * 1000000)::bigint AS ts_us
    FROM txlimit_state s
    WHERE s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text
      AND s.shard < sqlc.arg('shards')::integer
    ORDER BY s.shard
    FOR UPDATE
),
ev AS MATERIALIZED (
    SELECT l.shard,
           txlimit_level(sqlc.arg('kind')::smallint, l.value, l.ts_us, k.now_us, sqlc.arg('rate')::double precision,
                         sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision) AS lv,
           txlimit_next_ts(sqlc.arg('kind')::smallint, l.ts_us, k.now_us, sqlc.arg('period_us')::bigint) AS ts_us
    FROM lk l CROSS JOIN clock k
),
give AS MATERIALIZED (
    SELECT e.shard, e.lv, e.ts_us,
           least(e.lv + greatest(sqlc.arg('count')::double precision - coalesce(sum(sqlc.arg('cap')::double precision - e.lv)
                     OVER (ORDER BY e.lv, e.shard ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0), 0),
                 sqlc.arg('cap')::double precision) AS after
    FROM ev e
),
upd AS (
    UPDATE txlimit_state s
    SET value = g.after, ts = 'epoch'::timestamptz + g.ts_us * interval '1 microsecond'
    FROM give g
    WHERE s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = g.shard
      AND g.after > g.lv
    RETURNING s.shard
)
SELECT g.shard::integer AS shard,
       g.lv::double precision AS before,
       g.after::double precision AS after,
       k.now_us::bigint AS now_us,
       (SELECT count(*) FROM upd)::bigint AS updated
FROM give g CROSS JOIN clock k
ORDER BY g.shard;

-- name: Levels :many
-- Levels reads every shard row of (name, key) without locking and evaluates it at the clock: the
-- stored value and ts and the tokens it holds now. It always returns at least one row, carrying the
-- clock; a row with a NULL shard means there are no rows.
WITH clock AS MATERIALIZED (
    SELECT (extract(epoch FROM coalesce(sqlc.narg('now')::timestamptz, clock_timestamp())) * 1000000)::bigint AS now_us
)
SELECT s.shard,
       s.value,
       s.ts,
       coalesce(txlimit_level(sqlc.arg('kind')::smallint, s.value, (extract(epoch FROM s.ts) * 1000000)::bigint,
                              k.now_us, sqlc.arg('rate')::double precision, sqlc.arg('period_us')::bigint,
                              sqlc.arg('cap')::double precision), 0)::double precision AS level,
       k.now_us::bigint AS now_us
FROM clock k
LEFT JOIN txlimit_state s ON s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text
ORDER BY s.shard;

-- name: Reset :execrows
-- Reset deletes every shard row of (name, key): the limit is full again.
DELETE FROM txlimit_state WHERE name = sqlc.arg('name')::text AND key = sqlc.arg('key')::text;
