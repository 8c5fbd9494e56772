-- name: LockJob :one
-- LockJob locks a River job (FOR UPDATE) and returns what a cancel needs: its state, whether an
-- attempt has started, whether it was settled, and the reservation ReserveTx recorded in its
-- metadata (JSON null if none).
SELECT j.state::text AS state,
       (j.attempted_at IS NOT NULL)::boolean AS attempted,
       (j.metadata ? 'txlimit_settled')::boolean AS settled,
       coalesce(j.metadata -> 'txlimit_reserved', 'null'::jsonb)::jsonb AS reserved
FROM river_job j
WHERE j.id = sqlc.arg('id')::bigint
FOR UPDATE;

-- name: ClaimSettlement :many
-- ClaimSettlement records claim as the job's settlement (metadata key txlimit_settled) unless one
-- is recorded already, and returns the job's reservation. No row means the job is missing or
-- already settled: a concurrent settle waits for the row lock, then re-checks the condition on the
-- committed row (READ COMMITTED), so exactly one claim succeeds.
-- JSON parameters are sent as text and cast here: pgx's exec and simple-protocol modes (the ones a
-- transaction pooler needs) encode a []byte as bytea, which ::jsonb refuses.
UPDATE river_job j
SET metadata = jsonb_set(j.metadata, '{txlimit_settled}', sqlc.arg('claim')::text::jsonb, true)
WHERE j.id = sqlc.arg('id')::bigint AND NOT (j.metadata ? 'txlimit_settled')
RETURNING coalesce(j.metadata -> 'txlimit_reserved', 'null'::jsonb)::jsonb AS reserved;

-- name: Settlement :many
-- Settlement returns the settlement recorded on a job (JSON null if none); no row if the job is
-- missing.
SELECT coalesce(j.metadata -> 'txlimit_settled', 'null'::jsonb)::jsonb AS settled
FROM river_job j
WHERE j.id = sqlc.arg('id')::bigint;

-- name: RecordSettlement :exec
-- RecordSettlement stores the outcome of a settlement this transaction claimed. On a job no attempt
-- of which has started (one River cancelled or discarded before it ran, refunded with 0 used) it
-- also removes the payment ReserveTx recorded for its first attempt (txlimit_paid), as
-- RecordCancellation does: the job, should River bring it back (JobRetry), pays at its Gates.
UPDATE river_job j
SET metadata = jsonb_set(CASE WHEN j.attempted_at IS NULL THEN j.metadata - 'txlimit_paid' ELSE j.metadata END,
                         '{txlimit_settled}', sqlc.arg('outcome')::text::jsonb, true)
WHERE j.id = sqlc.arg('id')::bigint;

-- name: RecordCancellation :exec
-- RecordCancellation stores the outcome of a cancel as the job's settlement and removes the payment
-- ReserveTx recorded for its first attempt (txlimit_paid): the refund took back what it paid for,
-- so the job, should River bring it back (JobRetry), pays at its Gates like any other.
UPDATE river_job j
SET metadata = jsonb_set(j.metadata - 'txlimit_paid', '{txlimit_settled}', sqlc.arg('outcome')::text::jsonb, true)
WHERE j.id = sqlc.arg('id')::bigint;

-- name: Waiting :many
-- Waiting locks, in job ID order (arrival order), the reserved jobs from ID from_id on that have
-- not started and are due after now, whose metadata contains filter: {"txlimit_reserved":
-- {"limits": [{"name": ..., "key": ...}]}}, i.e. whose reservation includes that limit. The
-- containment test can use River's GIN index on metadata (river_job_metadata_index). Jobs locked
-- by another transaction are skipped: they keep their time, which is never too early.
SELECT j.id, j.scheduled_at, (j.metadata -> 'txlimit_reserved')::jsonb AS reserved
FROM river_job j
WHERE j.metadata @> sqlc.arg('filter')::text::jsonb
  AND j.id >= sqlc.arg('from_id')::bigint
  AND j.state IN ('available', 'scheduled', 'pending')
  AND j.attempted_at IS NULL
  AND j.scheduled_at > sqlc.arg('now')::timestamptz
ORDER BY j.id
FOR UPDATE SKIP LOCKED;

-- name: Reschedule :execrows
-- Reschedule moves each job ids[i] to scheduled_ats[i] and stores its updated reservation.
UPDATE river_job j
SET scheduled_at = u.scheduled_at,
    metadata = jsonb_set(j.metadata, '{txlimit_reserved}', u.reserved::jsonb, true)
FROM (SELECT unnest(sqlc.arg('ids')::bigint[]) AS id,
             unnest(sqlc.arg('scheduled_ats')::timestamptz[]) AS scheduled_at,
             unnest(sqlc.arg('reserveds')::text[]) AS reserved) u
WHERE j.id = u.id;

-- name: RiverTables :one
-- RiverTables reports whether river_job resolves on the connection's search_path, and that path.
SELECT (to_regclass('river_job') IS NOT NULL)::boolean AS present,
       current_setting('search_path')::text AS search_path;

-- name: SearchPath :one
-- SearchPath returns the connection's search_path.
SELECT current_setting('search_path')::text AS search_path;

-- name: WorkedQueues :many
-- WorkedQueues lists River's queue table: the queues River's clients work. A client writes each of
-- its queues there when it starts and every 10 minutes after; River deletes a queue 24 h after its
-- last report.
SELECT q.name FROM river_queue q ORDER BY q.name;

-- name: MarkStranded :many
-- MarkStranded marks (metadata key txlimit_stranded: when it ran, and the job's scheduled_at and
-- state, as below) at most 1000 reserved jobs not settled whose reservation neither runs nor comes
-- back, in ID order, and returns them with that state and whether River's queue table lists their
-- queue. Such a job is one of:
--   - "waiting": available, scheduled or retryable (never started, or put back by River after a
--     stopped client or a failed attempt) though due more than after_us microseconds before now
--     (the database's clock unless given);
--   - "pending": pending (River starts it only once something makes it available) as long past
--     its time;
--   - "cancelled" or "discarded": finalized by River before any attempt started (River's own
--     JobCancel, a unique conflict River's scheduler discarded), as long ago, with no refund.
-- A job is returned again only when it is stranded anew: in another of these states, or at
-- another scheduled_at (River retried it); a mark of an earlier version (only "at") stands for
-- "waiting" at any time. So each stranding is counted once, by whichever check finds it first;
-- jobs locked by a worker that is starting them are skipped.
WITH found AS (
    SELECT j.id, r.state
    FROM river_job j
    CROSS JOIN LATERAL (
        SELECT CASE WHEN j.state IN ('available', 'scheduled', 'retryable') THEN 'waiting' ELSE j.state::text END AS state
    ) r
    WHERE j.metadata ? 'txlimit_reserved'
      AND NOT (j.metadata ? 'txlimit_settled')
      AND ((j.state IN ('available', 'scheduled', 'retryable', 'pending')
            AND j.scheduled_at < coalesce(sqlc.narg('now')::timestamptz, now()) - sqlc.arg('after_us')::bigint * interval '1 microsecond')
        OR (j.state IN ('cancelled', 'discarded') AND j.attempted_at IS NULL
            AND coalesce(j.finalized_at, j.scheduled_at) < coalesce(sqlc.narg('now')::timestamptz, now()) - sqlc.arg('after_us')::bigint * interval '1 microsecond'))
      AND NOT (j.metadata ? 'txlimit_stranded'
               AND coalesce(j.metadata #>> '{txlimit_stranded,state}', 'waiting') = r.state
               AND coalesce((j.metadata #>> '{txlimit_stranded,scheduled_at}')::timestamptz = j.scheduled_at, true))
    ORDER BY j.id
    LIMIT 1000
    FOR UPDATE OF j SKIP LOCKED
)
UPDATE river_job j
SET metadata = jsonb_set(j.metadata, '{txlimit_stranded}',
                         jsonb_build_object('at', coalesce(sqlc.narg('now')::timestamptz, now()),
                                            'scheduled_at', j.scheduled_at, 'state', f.state), true)
FROM found f
WHERE j.id = f.id
RETURNING j.id, j.queue, j.scheduled_at, f.state::text AS state,
          (EXISTS (SELECT 1 FROM river_queue q WHERE q.name = j.queue))::boolean AS worked;
