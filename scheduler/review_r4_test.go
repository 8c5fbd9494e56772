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
