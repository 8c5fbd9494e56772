package scheduler_test

import (
	"context"
	"fmt"
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

// TestR7GateDenialOutlivesTheLimit: a denial's retry_at (d608cad) is kept across snoozes whatever
// happens to the limit meanwhile. A job denied on a limit whose RetryAfter saturates (a
// misconfigured tiny rate: TestGateDenialOfAnEndlessWait's) records a retry_at ~292 years away;
// once the limit is fixed (the GateRequest's Config now allows 1000/s) and has tokens, the job
// still only snoozes, and will until that retry_at: stuck forever. Before the retry_at record, a
// denied job asked again after one MaxSnooze and ran.
func TestR7GateDenialOutlivesTheLimit(t *testing.T) {
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

// TestR7GateNamelessOldPaymentRunsBeforeDue: before cd30f07 (a day old) a Gate recorded its
// payment without naming the limit: {"attempt": N, "due": T}. The current reader takes any
// payment without a name for ReserveTx's, which stands for every limit and has no due time, so a
// job an earlier Gate reserved for and snoozed until T runs at its next wake-up, before its
// tokens are due (and passes every other Gate unpaid). The version that wrote it snoozed it until T.
func TestR7GateNamelessOldPaymentRunsBeforeDue(t *testing.T) {
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

// TestR7ScheduledAtBeyondYear9999BlamesCount: b2b6cbf makes the caller's ScheduledAt part of the
// job's time, so a ScheduledAt after the year 9999 now reaches the check written for a huge
// reservation, which names "count" and says the call "reserves tokens due only at" that time,
// though one token, there now, was asked for: the *ArgumentError names the wrong argument.
func TestR7ScheduledAtBeyondYear9999BlamesCount(t *testing.T) {
	t.Parallel()
	b := setupCalls(t, ratelimit.Config{Rate: 1, Period: time.Hour, MaxReserved: 10})
	ctx := context.Background()
	require.NoError(t, inTx(t, b.pool, true, func(tx pgx.Tx) error {
		far := time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)
		_, err := b.sched.ReserveTx(ctx, tx, "calls", "", 1, callArgs{}, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{ScheduledAt: far}})
		var ae *ratelimit.ArgumentError
		require.ErrorAs(t, err, &ae)
		require.Equal(t, "ReserveOpts.InsertOpts.ScheduledAt", ae.Arg, "error: %v", err)
		return nil
	}))
}

// TestR7GateDenialOutlivesJobRetry: the same record outlives an operator's Client.JobRetry. A job
// denied for an hour is cancelled (River's JobCancel, the Gate's tokens are not at stake: none
// were taken), the limit gets its token back, and the job is retried: River keeps its attempt, so
// the denial's retry_at still applies and the retried job only snoozes, for the rest of the hour,
// with the token there.
func TestR7GateDenialOutlivesJobRetry(t *testing.T) {
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
	_, err = b.limiter.Credit(ctx, tx, "calls", "", 1, nil) // the token is back
	require.NoError(t, err)
	row, err := b.client.JobRetryTx(ctx, tx, res.Job.ID)
	require.NoError(t, err)
	res, err = w.WorkJob(ctx, t, tx, row)
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobCompleted, res.EventKind,
		"the retried job, its token there, snoozes on the denial it had before the retry: %s", res.Job.Metadata)
}
