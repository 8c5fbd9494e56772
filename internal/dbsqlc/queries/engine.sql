-- name: DecideOne :one
-- DecideOne decides a list of one request (a Limit, LimitN, Check or CheckN, a one-request
-- LimitMany or CheckMany, a Batcher's batch of one): txlimit_decide_one_v1 (migrations/), which
-- documents its arguments and output.
SELECT d.ok::boolean AS ok,
       d.reserved::boolean AS reserved,
       d.busy::boolean AS busy,
       d.level_sum::double precision AS level_sum,
       d.shard_a::integer AS shard_a,
       d.shard_b::integer AS shard_b,
       d.charged::integer AS charged,
       d.retry_at_us::bigint AS retry_at_us,
       d.now_us::bigint AS now_us,
       d.ts_us::bigint AS ts_us
FROM txlimit_decide_one_v1(
    sqlc.narg('now_us')::bigint, sqlc.arg('name')::text, sqlc.arg('key')::text,
    sqlc.arg('count')::double precision, sqlc.arg('allow')::double precision, sqlc.arg('dry')::boolean,
    sqlc.arg('step_us')::bigint, sqlc.arg('rate')::double precision, sqlc.arg('period_us')::bigint,
    sqlc.arg('cap')::double precision, sqlc.arg('anchor_us')::bigint,
    sqlc.arg('shards')::integer[], sqlc.arg('lock_key')::bigint
) d;

-- name: Decide :many
-- Decide decides a list of requests in one statement: txlimit_decide_v1 (migrations/), which
-- documents its arguments and output. One row per request, in list order.
SELECT d.ok::boolean AS ok,
       d.reserved::boolean AS reserved,
       d.busy::boolean AS busy,
       d.level_sum::double precision AS level_sum,
       d.shard_a::integer AS shard_a,
       d.shard_b::integer AS shard_b,
       d.charged::integer AS charged,
       d.retry_at_us::bigint AS retry_at_us,
       d.now_us::bigint AS now_us,
       d.ts_us::bigint AS ts_us
FROM txlimit_decide_v1(
    sqlc.narg('now_us')::bigint,
    sqlc.arg('grp')::integer[], sqlc.arg('count')::double precision[], sqlc.arg('allow')::double precision[],
    sqlc.arg('dry')::boolean[], sqlc.arg('fast')::boolean[], sqlc.arg('step_us')::bigint[],
    sqlc.arg('rate')::double precision[], sqlc.arg('period_us')::bigint[], sqlc.arg('cap')::double precision[],
    sqlc.arg('anchor_us')::bigint[], sqlc.arg('row_a')::integer[], sqlc.arg('row_b')::integer[],
    sqlc.arg('row_name')::text[], sqlc.arg('row_key')::text[], sqlc.arg('row_shard')::integer[],
    0
) d;
