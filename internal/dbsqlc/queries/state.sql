-- name: Credit :many
-- Credit gives count tokens back to the shard rows 0..shards-1 of (name, key), the emptiest first,
-- never above cap (the per-shard capacity): txlimit_credit_v1 (migrations/00004_txlimit_operations.sql)
-- does it and documents it. One row per existing shard row with its level before and after, or a
-- single row with shard -1 (carrying the clock) when there is none.
SELECT c.shard::integer AS shard, c.before::double precision AS before, c.after::double precision AS after,
       c.now_us::bigint AS now_us
FROM txlimit_credit_v1(sqlc.narg('now_us')::bigint, sqlc.arg('name')::text, sqlc.arg('key')::text,
                       sqlc.arg('shards')::integer, sqlc.arg('count')::double precision,
                       sqlc.arg('rate')::double precision, sqlc.arg('period_us')::bigint, sqlc.arg('step_us')::bigint,
                       sqlc.arg('cap')::double precision) c;

-- name: Levels :many
-- Levels reads every shard row of (name, key) without locking and evaluates it at the clock:
-- txlimit_levels_v1 (migrations/00004_txlimit_operations.sql), in shard order. It always returns
-- at least one row, carrying the clock; a row with shard -1 means there are no rows.
SELECT l.shard::integer AS shard, l.value::double precision AS value, l.ts_us::bigint AS ts_us,
       l.level::double precision AS level, l.now_us::bigint AS now_us
FROM txlimit_levels_v1(sqlc.narg('now_us')::bigint, sqlc.arg('name')::text, sqlc.arg('key')::text,
                       sqlc.arg('rate')::double precision, sqlc.arg('period_us')::bigint, sqlc.arg('step_us')::bigint,
                       sqlc.arg('cap')::double precision) l;

-- name: Reset :one
-- Reset deletes every shard row of (name, key), locked first in shard order, and returns how many:
-- txlimit_reset_v1 (migrations/00004_txlimit_operations.sql). The limit is full again.
SELECT txlimit_reset_v1(sqlc.arg('name')::text, sqlc.arg('key')::text)::bigint AS deleted;

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
