package scheduler_test

// Review r4: tests that pin findings of the review of package scheduler. Each fails on the code
// it was written against and passes once its finding is fixed.

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// TestReviewR4GateDenialKeepsJitter: a denied job is "snoozed until the RetryAt of the denial
// (plus Jitter), then tries again" (Gate; spec §9: "snoozed until RetryAt (plus jitter)"), the
// jitter being there "so that jobs denied together do not all come back together"
// (GateConfig.Jitter). A denial due 4.4 s later, with the deterministic jitter JitterFor("a", 2s)
// = 1.02 s, must not take its token before RetryAt + 1.02 s. The job is brought back after each
// snooze the Gate asks for, as River would bring it back.
func TestReviewR4GateDenialKeepsJitter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var clock atomic.Int64
	clock.Store(t0.UnixNano())
	now := func() time.Time { return time.Unix(0, clock.Load()).UTC() }
	// One token per 4.4 s, capacity 1, no reservations: after the first job, one is denied 4.4 s.
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1, Period: 4400 * time.Millisecond}}, now: now})
	const jitterMax = 2 * time.Second
	j := scheduler.JitterFor("a", jitterMax)
	require.Greater(t, j, time.Second)
	gate, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter, Jitter: jitterMax,
		Limit: func(job *rivertype.JobRow) (scheduler.GateRequest, bool) {
			return scheduler.GateRequest{Name: "calls", JitterKey: "a"}, job.Kind == callArgs{}.Kind()
		}})
	require.NoError(t, err)
	scheduler.SetGateNow(gate, now)
	w := testdb.RiverWorker(t, nil, &river.Config{Middleware: []rivertype.Middleware{gate}},
		river.WorkFunc(func(context.Context, *river.Job[callArgs]) error { return nil }))
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()

	res, err := w.Work(ctx, t, tx, callArgs{N: 1}, nil)
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobCompleted, res.EventKind) // the one token

	retryAt := t0.Add(4400 * time.Millisecond)
	job := (*rivertype.JobRow)(nil)
	for i := 0; ; i++ {
		require.Less(t, i, 10, "the job never ran")
		before := time.Now()
		if job == nil {
			res, err = w.Work(ctx, t, tx, callArgs{N: 2}, nil)
		} else {
			res, err = w.WorkJob(ctx, t, tx, job)
		}
		require.NoError(t, err)
		if res.EventKind == river.EventKindJobCompleted {
			break
		}
		require.Equal(t, river.EventKindJobSnoozed, res.EventKind)
		job = res.Job
		clock.Add(int64(job.ScheduledAt.Sub(before))) // River brings it back after its snooze
	}
	require.False(t, now().Before(retryAt.Add(j)),
		"the denied job ran at RetryAt + %s, before RetryAt + its jitter %s: the jitter was cut to what fits in one MaxSnooze (%s)",
		now().Sub(retryAt), j, scheduler.MaxSnooze)
}

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
