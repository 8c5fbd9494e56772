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

// TestR8GatePreviousVersionDenialOutlivesTheLimit: the version before 9f02ae5 (d608cad) recorded
// a denial as {"name", "key", "attempt", "retry_at": T}, without "due". The new rule reads the
// missing due as the zero time, so "now is not before due" always holds and the job only snoozes
// until T: the r7 bug (a denial outliving the limit, JobRetry, a credit) stays for every job
// denied by the previous version. Here the previous version denied the job for an hour; the limit
// now has its tokens, yet the job keeps snoozing (it would for the hour, or until 2316 for a
// saturated RetryAfter). 9f02ae5 reads the older nameless payments ({"attempt", "due"}) on
// purpose; this format of the day before is not.
func TestR8GatePreviousVersionDenialOutlivesTheLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1000, Capacity: 1000, Period: time.Second}}})
	gate, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter, Limit: gateCalls})
	require.NoError(t, err)
	var ran atomic.Int32
	w := testdb.RiverWorker(t, nil, &river.Config{Middleware: []rivertype.Middleware{gate}},
		river.WorkFunc(func(context.Context, *river.Job[callArgs]) error { ran.Add(1); return nil }))
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()

	// What d608cad left on a job it denied for an hour.
	retryAt := time.Now().Add(time.Hour).UTC().Format(time.RFC3339Nano)
	md := fmt.Sprintf(`{%q: {"limits": [{"name": "calls", "key": "", "attempt": 1, "retry_at": %q}]}}`, scheduler.MetadataKey, retryAt)
	res, err := w.Work(ctx, t, tx, callArgs{N: 1}, &river.InsertOpts{Metadata: []byte(md)})
	require.NoError(t, err)
	for i := 0; i < 5 && res.EventKind == river.EventKindJobSnoozed; i++ {
		res, err = w.WorkJob(ctx, t, tx, res.Job)
		require.NoError(t, err)
	}
	require.Equal(t, river.EventKindJobCompleted, res.EventKind,
		"a job denied by the previous version (no due recorded), its limit now with 1000 tokens, still snoozes until its retry_at %s: %s",
		retryAt, metadataValue(t, res.Job.Metadata, scheduler.MetadataKey))
	require.Equal(t, int32(1), ran.Load())
}

// TestR8GateEarlyAskSkipsJitter: a denial's due is g.now() after the answer plus RetryAfter, which
// runs from the database's Time, read when the statement started (before any row-lock wait).
// When the Gate's reading is W later than the database's (a lock wait or a slow round trip; or a
// worker whose clock is W behind the process that recorded the denial) due lies W after the
// denial's true RetryAt. A wake-up in that window is "before due", so the Gate asks, the limit
// grants, and the job runs at once: its jitter is lost. d608cad only snoozed there (until its
// retry_at), so the jitter was kept. Here: 1 token per 10 s, the denial's RetryAt is t0+10s,
// the last ask before it is answered 1 s late (due t0+11s), and the job wakes at t0+10.2s.
func TestR8GateEarlyAskSkipsJitter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var clock, lag atomic.Int64
	clock.Store(t0.UnixNano())
	dbNow := func() time.Time { return time.Unix(0, clock.Load()).UTC() }
	gateNow := func() time.Time { return time.Unix(0, clock.Load()+lag.Load()).UTC() }
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1, Period: 10 * time.Second}}, now: dbNow})
	const jitterMax = 4 * time.Second
	key := ""
	for i := 0; key == ""; i++ {
		if j := scheduler.JitterFor(fmt.Sprint("k", i), jitterMax); j > 2*time.Second && j < 3*time.Second {
			key = fmt.Sprint("k", i)
		}
	}
	j := scheduler.JitterFor(key, jitterMax)
	gate, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter, Jitter: jitterMax,
		Limit: func(job *rivertype.JobRow) (scheduler.GateRequest, bool) {
			return scheduler.GateRequest{Name: "calls", JitterKey: key}, job.Kind == callArgs{}.Kind()
		}})
	require.NoError(t, err)
	scheduler.SetGateNow(gate, gateNow)
	w := testdb.RiverWorker(t, nil, &river.Config{Middleware: []rivertype.Middleware{gate}},
		river.WorkFunc(func(context.Context, *river.Job[callArgs]) error { return nil }))
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()

	res, err := w.Work(ctx, t, tx, callArgs{N: 1}, nil)
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobCompleted, res.EventKind) // the one token; the next at t0+10s
	retryAt := t0.Add(10 * time.Second)

	clock.Add(int64(1200 * time.Millisecond)) // t0+1.2s: denied until t0+10s, snoozed MaxSnooze
	res, err = w.Work(ctx, t, tx, callArgs{N: 2}, nil)
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobSnoozed, res.EventKind)

	clock.Add(int64(scheduler.MaxSnooze)) // t0+5.7s: asks again; the answer reaches the Gate 1 s after the database read its clock
	lag.Store(int64(time.Second))
	res, err = w.WorkJob(ctx, t, tx, res.Job)
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobSnoozed, res.EventKind)
	lag.Store(0)

	clock.Add(int64(scheduler.MaxSnooze)) // t0+10.2s: after the denial's RetryAt, before RetryAt + jitter
	res, err = w.WorkJob(ctx, t, tx, res.Job)
	require.NoError(t, err)
	require.NotEqual(t, river.EventKindJobCompleted, res.EventKind,
		"the denied job ran at RetryAt + %s, before RetryAt + its jitter %s", dbNow().Sub(retryAt), j)
}
