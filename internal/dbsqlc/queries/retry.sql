-- name: OutOfDebtAt :many
-- OutOfDebtAt returns, for each row state (values[i], ts_us[i]) of a limit with the per-shard
-- numbers rates[i], period_us[i], step_us[i] and caps[i], the first microsecond at or after the
-- clock at which the row is out of debt: txlimit_retry_at with count 0 and allowance 0 on one row,
-- as a reservation's RetryAt is computed. One row per element, in order, i from 1.
WITH clock AS MATERIALIZED (
    SELECT txlimit_clock(sqlc.narg('now_us')::bigint) AS now_us
)
SELECT r.i::integer AS i,
       txlimit_retry_at((sqlc.arg('rates')::double precision[])[r.i], (sqlc.arg('period_us')::bigint[])[r.i],
                        (sqlc.arg('step_us')::bigint[])[r.i], (sqlc.arg('caps')::double precision[])[r.i],
                        0, 0, false, r.value, (sqlc.arg('ts_us')::bigint[])[r.i], NULL, NULL, k.now_us)::bigint AS retry_at_us
FROM clock k
CROSS JOIN unnest(sqlc.arg('values')::double precision[]) WITH ORDINALITY AS r(value, i)
ORDER BY r.i;
