-- name: DecideSharded :one
-- DecideSharded is Decide for one request on a sharded limit: a call of txlimit_decide_sharded
-- (migration 00004), which documents the steps, the arguments and the statuses: 0 granted and
-- written, 1 denied after the lock, 2 decided without a lock (dry run or fast denial), 3 re-run
-- needed, 4 busy (every candidate shard taken under REPEATABLE READ or SERIALIZABLE; nothing read
-- or written). shard_a and shard_b are the two candidates chosen from cands; charge says which of
-- them were charged (1, 2 or 3 for both).
SELECT d.status::integer AS status,
       d.charge::integer AS charge,
       d.shard_a::integer AS shard_a,
       d.shard_b::integer AS shard_b,
       d.ok_now::boolean AS ok_now,
       d.reserved::boolean AS reserved,
       d.level_a::double precision AS level_a,
       d.level_b::double precision AS level_b,
       d.end_a::double precision AS end_a,
       d.end_b::double precision AS end_b,
       d.ts_a_us::bigint AS ts_a_us,
       d.ts_b_us::bigint AS ts_b_us,
       d.now_us::bigint AS now_us
FROM txlimit_decide_sharded(
    sqlc.narg('now')::timestamptz, sqlc.arg('dry')::boolean, sqlc.arg('cands')::integer[],
    sqlc.arg('lock_base')::bigint, sqlc.arg('name')::text, sqlc.arg('key')::text,
    sqlc.arg('cap')::double precision, sqlc.arg('kind')::smallint, sqlc.arg('rate')::double precision,
    sqlc.arg('period_us')::bigint, sqlc.arg('count')::double precision, sqlc.arg('reserve')::boolean,
    sqlc.arg('max_reserved')::double precision, sqlc.arg('anchor_us')::bigint
) d;
