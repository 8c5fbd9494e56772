package scheduler_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// TestGateDenialDoesNotOutliveTheLimit: before a denial's RetryAt the Gate asks the limit again at
// every wake-up. A job denied on a limit whose RetryAfter saturates (a misconfigured tiny rate:
// TestGateDenialOfAnEndlessWait's) records a RetryAt ~292 years away; once the limit is fixed (the
// GateRequest's Config now allows 1000/s) and has tokens, the job runs at its next wake-up.
func TestGateDenialDoesNotOutliveTheLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var clock atomic.Int64
	clock.Store(t0.UnixNano())
	now := func() time.Time { return time.Unix(0, clock.Load()).UTC() }
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1, Period: time.Second}}, now: now})
	broken := &ratelimit.Config{Rate: 1e-9, Capacity: 1, Period: time.Hour}
	fixed := &ratelimit.Config{Rate: 1000, Capacity: 1000, Period: time.Second}
	var cfg atomic.Pointer[ratelimit.Config]
	cfg.Store(broken)
	gate, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter,
		Limit: func(job *rivertype.JobRow) (scheduler.GateRequest, bool) {
			return scheduler.GateRequest{Name: "calls", Config: cfg.Load()}, job.Kind == callArgs{}.Kind()
		}})
	require.NoError(t, err)
	scheduler.SetGateNow(gate, now)
	var ran atomic.Int32
	w := testdb.RiverWorker(t, nil, &river.Config{Middleware: []rivertype.Middleware{gate}},
		river.WorkFunc(func(context.Context, *river.Job[callArgs]) error { ran.Add(1); return nil }))
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()

	res, err := w.Work(ctx, t, tx, callArgs{N: 1}, nil)
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobCompleted, res.EventKind) // the one token
	res, err = w.Work(ctx, t, tx, callArgs{N: 2}, nil)
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobSnoozed, res.EventKind, "denied")

	cfg.Store(fixed) // the operator fixes the limit
	clock.Add(int64(time.Minute))
	for i := 0; i < 20 && res.EventKind == river.EventKindJobSnoozed; i++ {
		clock.Add(int64(scheduler.MaxSnooze)) // River brings it back after each snooze
		res, err = w.WorkJob(ctx, t, tx, res.Job)
		require.NoError(t, err)
	}
	require.Equal(t, river.EventKindJobCompleted, res.EventKind,
		"a minute and 20 snoozes after the limit was fixed (1000 tokens there), the denied job still snoozes: paid record %s",
		metadataValue(t, res.Job.Metadata, scheduler.MetadataKey))
	require.Equal(t, int32(2), ran.Load())
}

// TestGateNamelessOldPaymentWaitsForItsDue: versions before payments named their limit recorded a
// Gate's payment as {"attempt": N, "due": T}, for any Gate. A job an earlier Gate reserved for and
// snoozed until T keeps waiting until T, as that version did.
func TestGateNamelessOldPaymentWaitsForItsDue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, ratelimit.Config{Rate: 1, Period: time.Minute, MaxReserved: 10})
	gate, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter, Limit: gateCalls})
	require.NoError(t, err)
	clock := time.Now()
	scheduler.SetGateNow(gate, func() time.Time { return clock })
	var ran atomic.Int32
	w := testdb.RiverWorker(t, nil, &river.Config{Middleware: []rivertype.Middleware{gate}},
		river.WorkFunc(func(context.Context, *river.Job[callArgs]) error { ran.Add(1); return nil }))
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()

	// What the earlier Gate left on a job it reserved for: due in 50 s.
	due := clock.Add(50 * time.Second).UTC().Format(time.RFC3339Nano)
	md := fmt.Sprintf(`{%q: {"attempt": 1, "due": %q}}`, scheduler.MetadataKey, due)
	res, err := w.Work(ctx, t, tx, callArgs{N: 1}, &river.InsertOpts{Metadata: []byte(md)})
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobSnoozed, res.EventKind,
		"a job paid by an earlier Gate with tokens due at %s ran at %s, 50 s early", due, clock.UTC().Format(time.RFC3339Nano))
	require.Zero(t, ran.Load())
}

// TestGateDenialDoesNotOutliveJobRetry: a job denied for an hour is cancelled (River's JobCancel;
// none of the Gate's tokens were taken), the limit gets its token back, and the job is retried:
// River keeps its attempt, and with it the denial's record, but before the denial's RetryAt the
// Gate asks again, and the job runs.
func TestGateDenialDoesNotOutliveJobRetry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1, Period: time.Hour}}})
	gate, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter, Limit: gateCalls})
	require.NoError(t, err)
	w := testdb.RiverWorker(t, nil, &river.Config{Middleware: []rivertype.Middleware{gate}},
		river.WorkFunc(func(context.Context, *river.Job[callArgs]) error { return nil }))
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	res, err := w.Work(ctx, t, tx, callArgs{N: 1}, nil)
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobCompleted, res.EventKind) // the one token
	res, err = w.Work(ctx, t, tx, callArgs{N: 2}, nil)
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobSnoozed, res.EventKind, "denied for an hour")
	_, err = b.client.JobCancelTx(ctx, tx, res.Job.ID)
	require.NoError(t, err)
	_, err = b.limiter.Credit(ctx, b.pool, "calls", "", 1, nil) // the token is back (the Gate decides on the pool)
	require.NoError(t, err)
	row, err := b.client.JobRetryTx(ctx, tx, res.Job.ID)
	require.NoError(t, err)
	res, err = w.WorkJob(ctx, t, tx, row)
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobCompleted, res.EventKind,
		"the retried job, its token there, snoozes on the denial it had before the retry: %s", res.Job.Metadata)
}
