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
