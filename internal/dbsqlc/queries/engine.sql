-- name: Decide :many
-- Decide decides a list of requests in one statement: a call of txlimit_decide (migrations/), which
-- documents its arguments, steps and output. One row per request, in list order.
SELECT d.ok::boolean AS ok,
       d.reserved::boolean AS reserved,
       d.busy::boolean AS busy,
       d.level_sum::double precision AS level_sum,
       d.shard_a::integer AS shard_a,
       d.shard_b::integer AS shard_b,
       d.charged::integer AS charged,
       d.retry_at_us::bigint AS retry_at_us,
       d.now_us::bigint AS now_us
FROM txlimit_decide(
    sqlc.narg('now')::timestamptz,
    sqlc.arg('grp')::integer[], sqlc.arg('count')::double precision[], sqlc.arg('allow')::double precision[],
    sqlc.arg('dry')::boolean[], sqlc.arg('steer')::boolean[], sqlc.arg('kind')::smallint[],
    sqlc.arg('rate')::double precision[], sqlc.arg('period_us')::bigint[], sqlc.arg('cap')::double precision[],
    sqlc.arg('anchor_us')::bigint[], sqlc.arg('lock_base')::bigint[],
    sqlc.arg('cand_off')::integer[], sqlc.arg('cand_n')::integer[], sqlc.arg('cand_shard')::integer[],
    sqlc.arg('cand_row')::integer[],
    sqlc.arg('row_name')::text[], sqlc.arg('row_key')::text[], sqlc.arg('row_shard')::integer[],
    sqlc.arg('row_bulk')::boolean[]
) d;

-- name: DecideSingle :one
-- DecideSingle is Decide for a list of one request (a Limit, LimitN, Check or CheckN, a
-- one-request LimitMany or CheckMany, a Batcher's batch of one: the most common call): the same
-- call of txlimit_decide, its arrays built here from scalars, the candidate shards (cand_shard, in
-- the order they are tried), each candidate's row number (cand_row) and the rows' shards in lock
-- order (row_shard). Every row has the request's name and key, and is read before the decision
-- unless the request steers. This costs the client less to send than nineteen arrays.
SELECT d.ok::boolean AS ok,
       d.reserved::boolean AS reserved,
       d.busy::boolean AS busy,
       d.level_sum::double precision AS level_sum,
       d.shard_a::integer AS shard_a,
       d.shard_b::integer AS shard_b,
       d.charged::integer AS charged,
       d.retry_at_us::bigint AS retry_at_us,
       d.now_us::bigint AS now_us
FROM txlimit_decide(
    sqlc.narg('now')::timestamptz,
    '{0}'::integer[], ARRAY[sqlc.arg('count')::double precision], ARRAY[sqlc.arg('allow')::double precision],
    ARRAY[sqlc.arg('dry')::boolean], ARRAY[sqlc.arg('steer')::boolean], ARRAY[sqlc.arg('kind')::smallint],
    ARRAY[sqlc.arg('rate')::double precision], ARRAY[sqlc.arg('period_us')::bigint], ARRAY[sqlc.arg('cap')::double precision],
    ARRAY[sqlc.arg('anchor_us')::bigint], ARRAY[sqlc.arg('lock_base')::bigint],
    '{1}'::integer[], ARRAY[cardinality(sqlc.arg('cand_shard')::integer[])], sqlc.arg('cand_shard')::integer[],
    sqlc.arg('cand_row')::integer[],
    array_fill(sqlc.arg('name')::text, ARRAY[cardinality(sqlc.arg('row_shard')::integer[])]),
    array_fill(sqlc.arg('key')::text, ARRAY[cardinality(sqlc.arg('row_shard')::integer[])]),
    sqlc.arg('row_shard')::integer[],
    array_fill(NOT sqlc.arg('steer')::boolean, ARRAY[cardinality(sqlc.arg('row_shard')::integer[])])
) d;
