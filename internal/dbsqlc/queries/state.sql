-- name: Credit :many
-- Credit gives count tokens back to the shard rows 0..shards-1 of (name, key), never above cap (the
-- per-shard capacity). The rows are locked in shard order and the tokens go to the emptiest shards
-- first: each shard takes what the shards before it could not. Missing rows are full and take
-- nothing, so a credit never creates a row. Returns every existing shard row with its level before
-- and after, or a single row with shard -1 (carrying the clock) when there is none.
WITH clock AS MATERIALIZED (
    SELECT txlimit_clock(sqlc.narg('now_us')::bigint) AS now_us
),
lk AS MATERIALIZED (
    SELECT s.shard, s.value, s.ts
    FROM txlimit_state s
    WHERE s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text
      AND s.shard < sqlc.arg('shards')::integer
    ORDER BY s.shard
    FOR UPDATE
),
ev AS MATERIALIZED (
    SELECT l.shard,
           txlimit_level(l.value, l.ts, k.now_us, sqlc.arg('rate')::double precision, sqlc.arg('period_us')::bigint,
                         sqlc.arg('step_us')::bigint, sqlc.arg('cap')::double precision) AS lv,
           txlimit_next_ts(l.ts, k.now_us, sqlc.arg('step_us')::bigint) AS ts
    FROM lk l CROSS JOIN clock k
),
give AS MATERIALIZED (
    SELECT e.shard, e.lv, e.ts,
           least(e.lv + greatest(sqlc.arg('count')::double precision - coalesce(sum(sqlc.arg('cap')::double precision - e.lv)
                     OVER (ORDER BY e.lv, e.shard ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0), 0),
                 sqlc.arg('cap')::double precision) AS after
    FROM ev e
),
upd AS (
    UPDATE txlimit_state s
    SET value = g.after, ts = g.ts
    FROM give g
    WHERE s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = g.shard
      AND g.after > g.lv
    RETURNING s.shard
)
SELECT coalesce(g.shard, -1)::integer AS shard,
       coalesce(g.lv, 0)::double precision AS before,
       coalesce(g.after, 0)::double precision AS after,
       k.now_us::bigint AS now_us,
       (SELECT count(*) FROM upd)::bigint AS updated
FROM clock k LEFT JOIN give g ON true
ORDER BY g.shard;

-- name: Levels :many
-- Levels reads every shard row of (name, key) without locking and evaluates it at the clock: the
-- stored value and ts and the tokens it holds now. It always returns at least one row, carrying the
-- clock; a row with a NULL shard means there are no rows.
WITH clock AS MATERIALIZED (
    SELECT txlimit_clock(sqlc.narg('now_us')::bigint) AS now_us
)
SELECT s.shard,
       s.value,
       s.ts AS ts_us,
       coalesce(txlimit_level(s.value, s.ts, k.now_us, sqlc.arg('rate')::double precision, sqlc.arg('period_us')::bigint,
                              sqlc.arg('step_us')::bigint, sqlc.arg('cap')::double precision), 0)::double precision AS level,
       k.now_us::bigint AS now_us
FROM clock k
LEFT JOIN txlimit_state s ON s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text
ORDER BY s.shard;

-- name: Reset :execrows
-- Reset deletes every shard row of (name, key): the limit is full again. The subquery locks the rows
-- first, in shard order (its LockRows sits above its sort), so that Reset takes them in the global
-- order (name, key, shard) as every other call does (docs/spec.md §7); the DELETE then removes the
-- rows it holds, each in its latest version (under READ COMMITTED the DELETE follows a row updated
-- meanwhile to that version, which the subquery locked).
DELETE FROM txlimit_state s
USING (SELECT l.shard
       FROM txlimit_state l
       WHERE l.name = sqlc.arg('name')::text AND l.key = sqlc.arg('key')::text
       ORDER BY l.shard
       FOR UPDATE) lk
WHERE s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = lk.shard;

-- name: PruneCandidates :many
-- PruneCandidates lists, in key order after (after_key, after_shard), up to batch rows of a limit's
-- configured shards that are full at the clock. Whether each evaluates exactly as a missing row
-- (txlimit_prunable, which also needs the key's window grid) is decided by PruneDelete.
WITH clock AS MATERIALIZED (
    SELECT txlimit_clock(sqlc.narg('now_us')::bigint) AS now_us
)
SELECT s.key, s.shard, k.now_us::bigint AS now_us
FROM txlimit_state s CROSS JOIN clock k
WHERE s.name = sqlc.arg('name')::text
  AND (s.key, s.shard) > (sqlc.arg('after_key')::text, sqlc.arg('after_shard')::integer)
  AND s.shard < sqlc.arg('shards')::integer
  AND txlimit_level(s.value, s.ts, k.now_us, sqlc.arg('rate')::double precision, sqlc.arg('period_us')::bigint,
                    sqlc.arg('step_us')::bigint, sqlc.arg('cap')::double precision) >= sqlc.arg('cap')::double precision
ORDER BY s.key, s.shard
LIMIT sqlc.arg('batch')::integer;

-- name: PruneDelete :execrows
-- PruneDelete deletes the listed rows (keys[i], shards[i], the key's window grid starting at
-- anchors[i]) of a limit that evaluate exactly as missing rows at the clock (txlimit_prunable).
-- The subquery locks them first, in (key, shard) order (its LockRows sits above its sort), the
-- global order of docs/spec.md §7, whatever order the join finds them in. Under concurrency the lock
-- re-checks the latest version of each row, so a row charged since it was listed is locked but
-- not returned, and stays.
DELETE FROM txlimit_state s
USING (SELECT l.key, l.shard
       FROM txlimit_state l
       JOIN unnest(sqlc.arg('keys')::text[]) WITH ORDINALITY AS d(key, i)
         ON l.key = d.key AND l.shard = (sqlc.arg('shard_list')::integer[])[d.i]
       WHERE l.name = sqlc.arg('name')::text
         AND txlimit_prunable(l.value, l.ts, sqlc.arg('now_us')::bigint, sqlc.arg('rate')::double precision,
                              sqlc.arg('period_us')::bigint, sqlc.arg('step_us')::bigint, sqlc.arg('cap')::double precision,
                              (sqlc.arg('anchors')::bigint[])[d.i])
       ORDER BY l.key, l.shard
       FOR UPDATE OF l) lk
WHERE s.name = sqlc.arg('name')::text AND s.key = lk.key AND s.shard = lk.shard;
