-- name: DecideOne :one
-- DecideOne decides a list of one request (a Limit, LimitN, Check or CheckN, a one-request
-- LimitMany or CheckMany, a Batcher's batch of one); its answer is the 48 bytes of
-- txlimit_pack_v1 (migrations/00003_txlimit_decide.sql). shard is the row of an unsharded limit
-- (shards NULL); shards, for a sharded one, its candidate shards (see txlimit_decide_one_v1).
-- Under READ COMMITTED a Limit or LimitN on an unsharded limit is decided here by one UPDATE of
-- its row whose condition is the grant rule: Postgres evaluates it on the latest version of the
-- row, which the UPDATE holds, so the request is decided on the row it has locked. A call of its
-- own (no transaction ID yet) whose row, as the statement's snapshot has it, grants the request
-- first queues on the row's advisory lock (lock_key XOR the table's OID shifted left 20 bits XOR
-- the shard XOR bit 19), so that of the calls waiting for one row one at a time goes on to the
-- row; one that row refuses takes no queue lock. Anything that UPDATE does not write (a refusal, a
-- Check, a sharded limit, another isolation level, where a plain statement's plan could scan the
-- table) is decided by txlimit_decide_one_v1 in the same statement. The condition on the
-- isolation level is a constant of the statement: under REPEATABLE READ and SERIALIZABLE the
-- UPDATE reads nothing.
WITH u AS (
    UPDATE txlimit_state s
    SET value = txlimit_left(0, 1, txlimit_level(s.value, s.ts, c.t, sqlc.arg('rate')::double precision,
                                                 sqlc.arg('period_us')::bigint, sqlc.arg('step_us')::bigint,
                                                 sqlc.arg('cap')::double precision), 0, sqlc.arg('count')::double precision),
        ts = txlimit_next_ts(s.ts, c.t, sqlc.arg('step_us')::bigint)
    FROM (SELECT txlimit_clock(sqlc.narg('now_us')::bigint) AS t OFFSET 0) c
    WHERE current_setting('transaction_isolation') = 'read committed' AND NOT sqlc.arg('dry')::boolean
      AND sqlc.narg('shards')::integer[] IS NULL
      AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = sqlc.arg('shard')::integer
      AND CASE WHEN txlimit_granted(1, txlimit_left(0, 1, txlimit_level(s.value, s.ts, c.t, sqlc.arg('rate')::double precision,
                                                                        sqlc.arg('period_us')::bigint,
                                                                        sqlc.arg('step_us')::bigint,
                                                                        sqlc.arg('cap')::double precision),
                                                    0, sqlc.arg('count')::double precision),
                                    0, sqlc.arg('allow')::double precision)
               THEN pg_current_xact_id_if_assigned() IS NOT NULL
                    OR pg_advisory_xact_lock(sqlc.arg('lock_key')::bigint # ('txlimit_state'::regclass::oid::bigint << 20)
                                             # sqlc.arg('shard')::integer::bigint # 524288) IS NOT NULL
               ELSE false END
    RETURNING txlimit_written_v1(s.value, s.ts, c.t, sqlc.arg('shard')::integer, -1, 0, sqlc.arg('rate')::double precision,
                                 sqlc.arg('period_us')::bigint, sqlc.arg('step_us')::bigint,
                                 sqlc.arg('cap')::double precision) AS answer
)
SELECT coalesce((SELECT u.answer FROM u),
                txlimit_decide_one_v1(sqlc.narg('now_us')::bigint, sqlc.arg('name')::text, sqlc.arg('key')::text,
                                      sqlc.arg('count')::double precision, sqlc.arg('allow')::double precision,
                                      sqlc.arg('dry')::boolean, sqlc.arg('step_us')::bigint,
                                      sqlc.arg('rate')::double precision, sqlc.arg('period_us')::bigint,
                                      sqlc.arg('cap')::double precision, sqlc.arg('anchor_us')::bigint,
                                      coalesce(sqlc.narg('shards')::integer[], ARRAY[sqlc.arg('shard')::integer]),
                                      sqlc.arg('lock_key')::bigint,
                                      CASE WHEN current_setting('transaction_isolation') = 'read committed'
                                                AND NOT sqlc.arg('dry')::boolean AND sqlc.narg('shards')::integer[] IS NULL
                                           THEN sqlc.arg('shard')::integer END))::bytea AS answer;

-- name: Decide :many
-- Decide decides a list of requests in one statement: txlimit_decide_v1 (migrations/), which
-- documents its arguments. One row per request, in no particular order: i is the request's place
-- in the list, from 1, answer the 48 bytes of txlimit_pack_v1.
SELECT d.i::integer AS i, d.answer::bytea AS answer
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
