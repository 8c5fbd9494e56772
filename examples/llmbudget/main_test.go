package main

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// TestCancelTooLate: a user who gives up after the call has run gets no refund, in either mode,
// and the request is not counted as cancelled (run stops counting it among the calls to wait for
// only when it was). Before, -no-pull-forward refunded the whole estimate of a call that had run
// (River's JobCancelTx leaves a finished job as it is and returns no error, and the settlement of
// 0 that followed credited it anyway: a second credit after the job's own settlement), and run
// counted a call that was too late to cancel as cancelled, so it stopped waiting one call early.
func TestCancelTooLate(t *testing.T) {
	for _, mode := range []bool{false, true} {
		t.Run(map[bool]string{false: "CancelTx", true: "no-pull-forward"}[mode], func(t *testing.T) {
			*noPull = mode
			t.Cleanup(func() { *noPull = false })
			ctx := context.Background()
			pool, limiter, client, sched := setup(t)
			tl := newTimeline()

			// Request 0 takes 1000 of the budget; its call runs, uses 1000 and completes.
			var id int64
			require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				res, err := sched.ReserveTx(ctx, tx, limitName, org, 1000, CompletionArgs{Request: 0, Estimate: 1000}, nil)
				if err == nil {
					id = res.Job.ID
				}
				return err
			}))
			require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := sched.SettleTx(ctx, tx, id, 1000); err != nil {
					return err
				}
				// What JobCompleteTx does in the worker.
				_, err := tx.Exec(ctx, `UPDATE river_job SET state = 'completed', attempt = 1, attempted_at = now(),
					finalized_at = now() WHERE id = $1`, id)
				return err
			}))
			before, err := limiter.State(ctx, pool, limitName, org, nil)
			require.NoError(t, err)

			cancelled, err := cancel(ctx, pool, client, sched, limiter, tl, 0, id, 1000)
			require.NoError(t, err)
			require.False(t, cancelled, "a call that ran cannot be cancelled")
			require.Equal(t, 0, tl.cancels)
			after, err := limiter.State(ctx, pool, limitName, org, nil)
			require.NoError(t, err)
			// Nothing was credited: the budget only refilled meanwhile, at tpm per minute.
			refill := tpm * after.Time.Sub(before.Time).Seconds() / minute.Seconds()
			require.InDelta(t, before.Value+refill, after.Value, 1e-6, "the budget got tokens back for a call that ran")
		})
	}
}

// TestClientReportsStrandedReservations: the client of the example, which an application may copy,
// runs the stranded check (scheduler.Housekeeping), so that a reservation whose job nothing starts
// (a process that died before its calls ran, a queue no client works) is reported, not silent.
func TestClientReportsStrandedReservations(t *testing.T) {
	_, _, client, _ := setup(t)
	require.True(t, client.PeriodicJobs().RemoveByID("txlimit_stranded"), "the client has no stranded check")
	require.True(t, client.PeriodicJobs().RemoveByID("txlimit_prune"), "the client has no prune job")
}

// setup returns a pool on a fresh schema with txlimit's and River's tables, the example's limiter,
// and its River client and Scheduler (newClient), not started.
func setup(t *testing.T) (*pgxpool.Pool, *ratelimit.Limiter, *river.Client[pgx.Tx], *scheduler.Scheduler) {
	t.Helper()
	pool := testdb.Pool(t, nil)
	require.NoError(t, scheduler.Migrate(context.Background(), pool, nil))
	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		limitName: {Rate: tpm, Period: minute, MaxReserved: maxOwed},
	}})
	require.NoError(t, err)
	client, sched, err := newClient(pool, limiter, &completionWorker{pool: pool, limiter: limiter, tl: newTimeline()})
	require.NoError(t, err)
	return pool, limiter, client, sched
}
