package scheduler_test

// Review r4: tests that pin findings of the review of package scheduler. Each fails on the code
// it was written against and passes once its finding is fixed.

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// TestReviewR4DuplicateReportsExistingJobsTime: when River skips the insert as a duplicate, the
// reservation "was credited back ... and Job is the existing job", yet Reservation.RetryAt and
// ScheduledAt ("when the job is due: RetryAt plus Jitter") describe the reservation that was
// credited back: the existing job runs now, the Reservation says it is due in 60 s.
func TestReviewR4DuplicateReportsExistingJobsTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)
	_, sched := testdb.InsertScheduler(t, b.pool, b.limiter, nil)
	for i, dup := range []bool{false, true} {
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			res, err := sched.ReserveTx(ctx, tx, "calls", "u1", 10, uniqueArgs{Doc: "d1"}, nil)
			require.NoError(t, err)
			require.Equal(t, dup, res.Duplicate, "insert %d", i)
			if dup {
				require.True(t, res.ScheduledAt.IsZero() || res.ScheduledAt.Equal(res.Job.ScheduledAt),
					"Reservation.ScheduledAt %s, but the job (the existing one) is due at %s", res.ScheduledAt, res.Job.ScheduledAt)
				require.True(t, res.RetryAt.IsZero(), "Reservation.RetryAt %s for tokens that were credited back", res.RetryAt)
			}
			return nil
		}))
	}
	require.Equal(t, 0.0, value(t, b, "calls", "u1"))
}

// TestReviewR4InvalidQueueNameIsBadInput: the job's insert options are bad input ("a job River
// refuses (arguments it cannot encode, invalid insert options) | nothing written | error matching
// ratelimit.ErrInvalid", docs/scheduler.md). Once River's queue table lists a queue, an invalid
// queue name is instead a *SetupError (ErrQueueNotWorked, "It is not bad input"), whose fix says
// to add "bad queue!" to river.Config.Queues, a name River refuses there too.
func TestReviewR4InvalidQueueNameIsBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)
	_, sched := testdb.InsertScheduler(t, b.pool, b.limiter, nil)
	b.workQueues(t, "llm")
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		_, err := sched.ReserveTx(ctx, tx, "calls", "u1", 1, callArgs{}, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{Queue: "bad queue!"}})
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
		return nil
	}))
	require.Equal(t, 10.0, value(t, b, "calls", "u1"))
}
