-- name: DecideOneRow :one
-- DecideOneRow decides a Limit or LimitN on an unsharded limit (a list of one request charging one
-- row, not a Check; a Batcher's batch of one such call); its answer is the 48 bytes of
-- txlimit_pack_v1 (migrations/00003_txlimit_decide.sql). Under READ COMMITTED the request is first
-- decided by one UPDATE of its row whose condition is the grant rule with no allowance below zero:
-- Postgres evaluates it on the latest version of the row, which the UPDATE holds, so the request
-- is decided on the row it has locked, and what it writes is a grant that leaves the row at zero
-- or above. A call of its own (no transaction ID yet) whose row, as the statement's snapshot has
-- it, grants the request first queues on the row's advisory lock (queue_key XOR the table's OID
-- shifted left 20 bits; queue_key is the row's lock key XOR bit 19), so that of the calls waiting
-- for one row one at a time goes on to the row; one that row refuses takes no queue lock. Anything
-- that UPDATE does not write (a refusal, a reservation below zero, a missing row, another
-- isolation level, where a plain statement's plan could scan the table) is decided by
-- txlimit_decide_one_v1 in the same statement, told that the UPDATE ran. The condition on the
-- isolation level is a constant of the statement: under REPEATABLE READ and SERIALIZABLE the
-- UPDATE reads nothing. The clock is read once, in c, for the UPDATE and the fallback alike
-- (docs/spec.md §2; the fallback's p_t_us): read again by the fallback, after the UPDATE waited
-- for the row, it would be a second reading, later than the one the statement started with. The
-- fallback still gets now_us itself, so that on the database's clock a row it has to create is
-- decided at a reading taken once it holds it (§1).
WITH c AS MATERIALIZED (
    SELECT txlimit_clock(sqlc.narg('now_us')::bigint) AS t
), u AS (
    UPDATE txlimit_state s
    SET value = txlimit_left(0, 1, txlimit_level(s.value, s.ts, c.t, sqlc.arg('rate')::double precision,
                                                 sqlc.arg('period_us')::bigint, sqlc.arg('step_us')::bigint,
                                                 sqlc.arg('cap')::double precision), 0, sqlc.arg('count')::double precision),
        ts = txlimit_next_ts(s.ts, c.t, sqlc.arg('step_us')::bigint)
    FROM c
    WHERE current_setting('transaction_isolation') = 'read committed'
      AND s.name = sqlc.arg('name')::text AND s.key = sqlc.arg('key')::text AND s.shard = 0
      AND CASE WHEN txlimit_granted(1, txlimit_left(0, 1, txlimit_level(s.value, s.ts, c.t, sqlc.arg('rate')::double precision,
                                                                        sqlc.arg('period_us')::bigint,
                                                                        sqlc.arg('step_us')::bigint,
                                                                        sqlc.arg('cap')::double precision),
                                                    0, sqlc.arg('count')::double precision),
                                    0, 0)
               THEN pg_current_xact_id_if_assigned() IS NOT NULL
                    OR pg_advisory_xact_lock(sqlc.arg('queue_key')::bigint # ('txlimit_state'::regclass::oid::bigint << 20))
                       IS NOT NULL
               ELSE false END
    RETURNING txlimit_pack_v1(true, false, false, s.value, 0, -1, 1, 0, c.t, s.ts) AS answer
)
SELECT coalesce((SELECT u.answer FROM u),
                txlimit_decide_one_v1(sqlc.narg('now_us')::bigint, sqlc.arg('name')::text, sqlc.arg('key')::text,
                                      sqlc.arg('count')::double precision, sqlc.arg('allow')::double precision, false,
                                      sqlc.arg('step_us')::bigint, sqlc.arg('rate')::double precision,
                                      sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision,
                                      sqlc.arg('anchor_us')::bigint, '{0}', sqlc.arg('lock_key')::bigint, true,
                                      (SELECT c.t FROM c)))::bytea AS answer;

-- name: DecideOne :one
-- DecideOne decides any other list of one request (a Check or CheckN, a call on a sharded limit)
-- by txlimit_decide_one_v1, which documents its arguments; its answer is the 48 bytes of
-- txlimit_pack_v1. shards: the candidate shards ({0} when unsharded).
SELECT txlimit_decide_one_v1(sqlc.narg('now_us')::bigint, sqlc.arg('name')::text, sqlc.arg('key')::text,
                             sqlc.arg('count')::double precision, sqlc.arg('allow')::double precision,
                             sqlc.arg('dry')::boolean, sqlc.arg('step_us')::bigint, sqlc.arg('rate')::double precision,
                             sqlc.arg('period_us')::bigint, sqlc.arg('cap')::double precision,
                             sqlc.arg('anchor_us')::bigint, sqlc.arg('shards')::integer[], sqlc.arg('lock_key')::bigint,
                             false, NULL)::bytea AS answer;

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
