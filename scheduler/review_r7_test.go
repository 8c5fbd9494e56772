package scheduler_test

import (
	"context"
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
