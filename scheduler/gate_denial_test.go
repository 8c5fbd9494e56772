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
	clock := newTestClock(t0)
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1, Period: time.Second}}, now: clock.Now})
	broken := &ratelimit.Config{Rate: 1e-9, Capacity: 1, Period: time.Hour}
	fixed := &ratelimit.Config{Rate: 1000, Capacity: 1000, Period: time.Second}
	var cfg atomic.Pointer[ratelimit.Config]
	cfg.Store(broken)
	gate, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter,
		Limit: func(job *rivertype.JobRow) (scheduler.GateRequest, bool) {
			return scheduler.GateRequest{Name: "calls", Config: cfg.Load()}, job.Kind == callArgs{}.Kind()
		}})
	require.NoError(t, err)
	scheduler.SetGateNow(gate, clock.Now)
	var ran atomic.Int32
	w, tx := gateWorker(t, b, &ran, gate)

	work(t, w, tx, river.EventKindJobCompleted, callArgs{N: 1}, nil) // the one token
	res := work(t, w, tx, river.EventKindJobSnoozed, callArgs{N: 2}, nil, "denied")

	cfg.Store(fixed) // the operator fixes the limit
	clock.Add(time.Minute)
	for i := 0; i < 20 && res.EventKind == river.EventKindJobSnoozed; i++ {
		clock.Add(scheduler.MaxSnooze) // River brings it back after each snooze
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
	clock := newTestClock(time.Now())
	gate := callsGate(t, b, clock)
	var ran atomic.Int32
	w, tx := gateWorker(t, b, &ran, gate)

	// What the earlier Gate left on a job it reserved for: due in 50 s.
	due := clock.Now().Add(50 * time.Second).Format(time.RFC3339Nano)
	md := fmt.Sprintf(`{%q: {"attempt": 1, "due": %q}}`, scheduler.MetadataKey, due)
	res, err := w.Work(ctx, t, tx, callArgs{N: 1}, &river.InsertOpts{Metadata: []byte(md)})
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobSnoozed, res.EventKind,
		"a job paid by an earlier Gate with tokens due at %s ran at %s, 50 s early", due, clock.Now().Format(time.RFC3339Nano))
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
	gate := callsGate(t, b, nil)
	w, tx := gateWorker(t, b, nil, gate)
	work(t, w, tx, river.EventKindJobCompleted, callArgs{N: 1}, nil) // the one token
	res := work(t, w, tx, river.EventKindJobSnoozed, callArgs{N: 2}, nil, "denied for an hour")
	_, err := b.client.JobCancelTx(ctx, tx, res.Job.ID)
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

// TestGateDenialWithoutDueIsAskedAbout: an earlier version recorded a denial as {"name", "key",
// "attempt", "retry_at": T}, without "due". Such a record is asked about at once: here that
// version denied the job for an hour, the limit now has its tokens, and the job runs.
func TestGateDenialWithoutDueIsAskedAbout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1000, Capacity: 1000, Period: time.Second}}})
	gate := callsGate(t, b, nil)
	var ran atomic.Int32
	w, tx := gateWorker(t, b, &ran, gate)

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

// TestGateDenialJitterSurvivesALateAnswer: the Gate's clock when it records a denial can be W
// later than the database's when it answered (a lock wait, a slow round trip, or a worker whose
// clock is W ahead of the next one's), so the recorded due can lie W after the denial's true
// RetryAt. A wake-up in that window must not ask (the limit would grant, and the job run without
// its jitter): the Gate only waits from one snooze before due. Here: 1 token per 10 s, the
// denial's RetryAt is t0+10s, the last ask before it is answered 1 s late (due t0+11s), and the
// job wakes at t0+10.2s.
func TestGateDenialJitterSurvivesALateAnswer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	clock := newTestClock(t0)
	var lag atomic.Int64
	dbNow := clock.Now
	gateNow := func() time.Time { return clock.Now().Add(time.Duration(lag.Load())) }
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
	w, tx := gateWorker(t, b, nil, gate)

	work(t, w, tx, river.EventKindJobCompleted, callArgs{N: 1}, nil) // the one token; the next at t0+10s
	retryAt := t0.Add(10 * time.Second)

	clock.Add(1200 * time.Millisecond) // t0+1.2s: denied until t0+10s, snoozed MaxSnooze
	res := work(t, w, tx, river.EventKindJobSnoozed, callArgs{N: 2}, nil)

	clock.Add(scheduler.MaxSnooze) // t0+5.7s: asks again; the answer reaches the Gate 1 s after the database read its clock
	lag.Store(int64(time.Second))
	res = workAgain(t, w, tx, river.EventKindJobSnoozed, res.Job)
	lag.Store(0)

	clock.Add(scheduler.MaxSnooze) // t0+10.2s: after the denial's RetryAt, before RetryAt + jitter
	res, err = w.WorkJob(ctx, t, tx, res.Job)
	require.NoError(t, err)
	require.NotEqual(t, river.EventKindJobCompleted, res.EventKind,
		"the denied job ran at RetryAt + %s, before RetryAt + its jitter %s", dbNow().Sub(retryAt), j)
}
