-- name: DecideOne :one
-- DecideOne decides a list of one request (a Limit, LimitN, Check or CheckN, a one-request
-- LimitMany or CheckMany, a Batcher's batch of one): txlimit_decide_one_v1 (migrations/), which
-- documents its arguments; its answer is the eight numbers of txlimit_pack_v1.
SELECT txlimit_decide_one_v1(
    sqlc.narg('now_us')::bigint, sqlc.arg('name')::text, sqlc.arg('key')::text,
    sqlc.arg('count')::double precision, sqlc.arg('allow')::double precision, sqlc.arg('dry')::boolean,
    sqlc.arg('step_us')::bigint, sqlc.arg('rate')::double precision, sqlc.arg('period_us')::bigint,
    sqlc.arg('cap')::double precision, sqlc.arg('anchor_us')::bigint,
    sqlc.arg('shards')::integer[], sqlc.arg('lock_key')::bigint
)::bigint[] AS answer;

-- name: Decide :many
-- Decide decides a list of requests in one statement: txlimit_decide_v1 (migrations/), which
-- documents its arguments and output (txlimit_answer_v1). One row per request, in no particular
-- order: i is the request's place in the list, from 1.
SELECT d.i::integer AS i,
       d.ok::boolean AS ok,
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

-- name: WaitForShard :exec
-- WaitForShard waits, in a statement of its own, until no transaction is deciding on the given
-- shard of a sharded limit (the advisory lock txlimit_steer tries; lock_key is the hash of name and
-- key), and lets go of it at once: what InSerializableTx does after a busy call before it retries.
SELECT pg_advisory_xact_lock(sqlc.arg('lock_key')::bigint # ('txlimit_state'::regclass::oid::bigint << 20)
                             # sqlc.arg('shard')::bigint);
