package scheduler_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertest"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// callsGate returns a Gate of callArgs jobs over b's limit "calls" (gateCalls), on clock's time
// when clock is not nil.
func callsGate(t *testing.T, b *testBundle, clock *testClock) *scheduler.Gate {
	t.Helper()
	gate, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter, Limit: gateCalls})
	require.NoError(t, err)
	if clock != nil {
		scheduler.SetGateNow(gate, clock.Now)
	}
	return gate
}

// gateCalls gates callArgs jobs by the limit "calls", keyed by nothing.
func gateCalls(job *rivertype.JobRow) (scheduler.GateRequest, bool) {
	return scheduler.GateRequest{Name: "calls"}, job.Kind == callArgs{}.Kind()
}

func TestGate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// One call a minute, with at most one owed.
	b := setup(t, &setupOpts{
		limits: map[string]ratelimit.Config{"calls": {Rate: 1, Period: time.Minute, MaxReserved: 1}},
		now:    frozen(t0),
	})
	clock := newTestClock(time.Now())
	gate := callsGate(t, b, clock)
	var ran atomic.Int32
	w, tx := gateWorker(t, b, &ran, gate)

	// step 1: the token is there: the job takes it and runs.
	work(t, w, tx, river.EventKindJobCompleted, callArgs{N: 1}, nil)
	require.Equal(t, int32(1), ran.Load())
	require.Equal(t, 0.0, value(t, b, "calls", ""))

	// step 2: empty: the job reserves the next token, due in 60 s, records the payment and is
	// snoozed for MaxSnooze, still available (River keeps short snoozes available), its attempt
	// given back.
	before := time.Now()
	res, err := w.Work(ctx, t, tx, callArgs{N: 2}, nil)
	after := time.Now()
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobSnoozed, res.EventKind)
	require.Equal(t, int32(1), ran.Load())
	require.Equal(t, -1.0, value(t, b, "calls", ""))
	job := res.Job
	require.Equal(t, 0, job.Attempt, "a snooze does not consume an attempt")
	require.Equal(t, rivertype.JobStateAvailable, job.State)
	requireSnoozedFor(t, scheduler.MaxSnooze, before, after, job.ScheduledAt)
	var p struct {
		Limits []struct {
			Name    string    `json:"name"`
			Key     string    `json:"key"`
			Attempt int       `json:"attempt"`
			Due     time.Time `json:"due"`
		} `json:"limits"`
	}
	require.NoError(t, json.Unmarshal(metadataValue(t, job.Metadata, scheduler.MetadataKey), &p))
	require.Len(t, p.Limits, 1)
	require.Equal(t, "calls", p.Limits[0].Name)
	require.Equal(t, 1, p.Limits[0].Attempt)
	require.True(t, p.Limits[0].Due.Equal(clock.Now().Add(time.Minute)), "due %s", p.Limits[0].Due)

	// step 3: woken before it is due, it snoozes again for the rest, paying nothing.
	clock.Add(58 * time.Second)
	before = time.Now()
	res, err = w.WorkJob(ctx, t, tx, job)
	after = time.Now()
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobSnoozed, res.EventKind)
	require.Equal(t, 0, res.Job.Attempt)
	requireSnoozedFor(t, 2*time.Second, before, after, res.Job.ScheduledAt)
	require.Equal(t, -1.0, value(t, b, "calls", ""))

	// step 4: due: it runs without paying again, and its payment is cleared.
	clock.Add(2 * time.Second)
	res = workAgain(t, w, tx, river.EventKindJobCompleted, res.Job)
	require.Equal(t, 1, res.Job.Attempt)
	require.Equal(t, int32(2), ran.Load())
	require.Equal(t, -1.0, value(t, b, "calls", ""))
	require.Equal(t, "null", string(metadataValue(t, res.Job.Metadata, scheduler.MetadataKey)))

	// step 5: one more would owe 2 > MaxReserved: nothing is taken, no payment recorded, only the
	// denial's RetryAt (due, in 60 s) and that plus the jitter (retry_at, the same here: no
	// jitter); the job is snoozed (at most MaxSnooze).
	res = work(t, w, tx, river.EventKindJobSnoozed, callArgs{N: 3}, nil)
	require.Equal(t, 0, res.Job.Attempt)
	var denied struct {
		Limits []map[string]any `json:"limits"`
	}
	require.NoError(t, json.Unmarshal(metadataValue(t, res.Job.Metadata, scheduler.MetadataKey), &denied))
	require.Len(t, denied.Limits, 1)
	retryAt, err := time.Parse(time.RFC3339Nano, denied.Limits[0]["retry_at"].(string))
	require.NoError(t, err)
	require.True(t, retryAt.Equal(clock.Now().Add(time.Minute)), "retry_at %s", retryAt)
	due, err := time.Parse(time.RFC3339Nano, denied.Limits[0]["due"].(string))
	require.NoError(t, err)
	require.True(t, due.Equal(retryAt), "due %s", due)
	delete(denied.Limits[0], "retry_at")
	delete(denied.Limits[0], "due")
	require.Equal(t, map[string]any{"name": "calls", "key": "", "attempt": 1.0}, denied.Limits[0], "a denial: nothing paid")
	require.Equal(t, -1.0, value(t, b, "calls", ""))
	require.Equal(t, int32(2), ran.Load())

	// step 6: a job of ReserveTx was paid when it was scheduled: the gate lets it through.
	r, err := b.sched.ReserveTx(ctx, tx, "calls", "", 1, callArgs{N: 4}, &scheduler.ReserveOpts{Config: &ratelimit.Config{Rate: 1, Period: time.Minute, MaxReserved: ratelimit.Unbounded}})
	require.NoError(t, err)
	st, err := b.limiter.State(ctx, tx, "calls", "", nil)
	require.NoError(t, err)
	require.Equal(t, -2.0, st.Value)
	workAgain(t, w, tx, river.EventKindJobCompleted, r.Job)
	require.Equal(t, int32(3), ran.Load())
}

// requireSnoozedFor asserts that a job worked between before and after was snoozed for d: River
// schedules it d after the instant it snoozes, which lies between the two (less the microsecond
// Postgres truncates to).
func requireSnoozedFor(t *testing.T, d time.Duration, before, after, scheduledAt time.Time) {
	t.Helper()
	lo, hi := before.Add(d-time.Microsecond), after.Add(d)
	require.True(t, !scheduledAt.Before(lo) && !scheduledAt.After(hi),
		"scheduled at %s, want %s after the snooze: between %s and %s", scheduledAt, d, lo, hi)
}

// TestGateRate: 50 jobs through a limit of 10/s (burst 10) all complete, at the rate, none failed.
func TestGateRate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const n = 50
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 10, Period: time.Second, MaxReserved: ratelimit.Unbounded}}, maxConns: 16})
	gate := callsGate(t, b, nil)
	st := newStarts()
	client := newClient(t, b.pool, &clientOpts{
		middleware: []rivertype.Middleware{gate},
		queues:     map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(20)},
		work: func(ctx context.Context, job *river.Job[callArgs]) error {
			st.record(job.ID, time.Now())
			return nil
		},
	})
	params := make([]river.InsertManyParams, n)
	for i := range params {
		params[i] = river.InsertManyParams{Args: callArgs{N: i}}
	}
	start := time.Now()
	_, err := client.InsertMany(ctx, params)
	require.NoError(t, err)
	startClient(t, client)
	st.wait(t, n, 30*time.Second)
	elapsed := time.Since(start)
	t.Logf("%d jobs through 10/s in %s", n, elapsed)

	// 10 tokens at first and 10 a second after: the 50th cannot start before 4 s.
	require.GreaterOrEqual(t, elapsed, 4*time.Second)
	var at []time.Time
	for _, v := range st.at {
		at = append(at, v)
	}
	slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
	require.Len(t, at, n, "each job ran once")
	// And not much after: from the first start, the 50th is due at 4 s. A job that paid twice
	// would push the last start towards 9 s. Measured from the first start, so that the client's
	// start-up does not count; the 3 s of slack are for a loaded machine.
	require.Less(t, at[n-1].Sub(at[0]), 7*time.Second, "the last job started %s after the first", at[n-1].Sub(at[0]))
	for k, s := range at { // the k-th start needs k+1 tokens: 10 + 10/s after the first decision
		if earliest := start.Add(time.Duration(k-9) * 100 * time.Millisecond); s.Before(earliest) {
			t.Errorf("start %d at %s, before %s: over-granted", k, s.Sub(start), earliest.Sub(start))
		}
	}
	bad, err := client.JobList(ctx, river.NewJobListParams().States(
		rivertype.JobStateRetryable, rivertype.JobStateDiscarded, rivertype.JobStateCancelled).First(100))
	require.NoError(t, err)
	require.Empty(t, bad.Jobs, "no job failed, was discarded or cancelled")
}

// TestGateTwoGatesPayEach: a job behind two Gates (one global, one of its worker), each of its own
// limit, pays both: the second never takes the first one's payment for its own. Both limits are
// empty; the job reserves on "a" and waits; when a's token is due it reserves on "b" (it does not
// run without touching "b").
func TestGateTwoGatesPayEach(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{
		limits: map[string]ratelimit.Config{
			"a": {Rate: 1, Period: time.Minute, MaxReserved: 1},
			"b": {Rate: 1, Period: time.Minute, MaxReserved: 1},
		},
		now: frozen(t0),
	})
	isCall := func(job *rivertype.JobRow) bool { return job.Kind == callArgs{}.Kind() }
	gate := func(name string) *scheduler.Gate {
		g, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter,
			Limit: func(job *rivertype.JobRow) (scheduler.GateRequest, bool) {
				return scheduler.GateRequest{Name: name}, isCall(job)
			}})
		require.NoError(t, err)
		return g
	}
	gateA, gateB := gate("a"), gate("b")
	clock := time.Now()
	scheduler.SetGateNow(gateA, func() time.Time { return clock })
	scheduler.SetGateNow(gateB, func() time.Time { return clock })
	var ran atomic.Int32
	w, tx := gateWorker(t, b, &ran, gateA, gateB)
	for _, name := range []string{"a", "b"} { // both limits empty
		res, err := b.limiter.Limit(ctx, b.pool, name, "", nil)
		require.NoError(t, err)
		require.True(t, res.OK)
	}

	res := work(t, w, tx, river.EventKindJobSnoozed, callArgs{N: 1}, nil) // reserved on "a"
	require.Equal(t, -1.0, value(t, b, "a", ""))

	clock = clock.Add(time.Minute) // a's token is due
	workAgain(t, w, tx, river.EventKindJobSnoozed, res.Job, "b is empty: the job reserves there and waits")
	require.Equal(t, -1.0, value(t, b, "b", ""))
	require.Zero(t, ran.Load())
}

// TestGateDenialOfAnEndlessWait: a denial whose RetryAfter saturates (a debt a tiny rate would
// pay in thousands of years) snoozes the longest snooze, jitter or not; before, the jitter
// overflowed the sum and the job came back after a millisecond, at every poll.
func TestGateDenialOfAnEndlessWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1e-9, Capacity: 1, Period: time.Hour}}})
	gate, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter, Jitter: time.Second,
		Limit: func(job *rivertype.JobRow) (scheduler.GateRequest, bool) {
			return scheduler.GateRequest{Name: "calls", JitterKey: "k"}, job.Kind == callArgs{}.Kind()
		}})
	require.NoError(t, err)
	w, tx := gateWorker(t, b, nil, gate)
	work(t, w, tx, river.EventKindJobCompleted, callArgs{N: 1}, nil) // the one token
	before := time.Now()
	res, err := w.Work(ctx, t, tx, callArgs{N: 2}, nil)
	after := time.Now()
	require.NoError(t, err)
	require.Equal(t, river.EventKindJobSnoozed, res.EventKind)
	requireSnoozedFor(t, scheduler.MaxSnooze, before, after, res.Job.ScheduledAt)
}

// gateWorker returns a worker of callArgs jobs behind gates, counting the job's runs in ran (when
// not nil), and a transaction to work them in, rolled back when the test ends.
func gateWorker(t *testing.T, b *testBundle, ran *atomic.Int32, gates ...rivertype.Middleware) (*rivertest.Worker[callArgs, pgx.Tx], pgx.Tx) {
	t.Helper()
	w := testdb.RiverWorker(t, nil, &river.Config{Middleware: gates},
		river.WorkFunc(func(context.Context, *river.Job[callArgs]) error {
			if ran != nil {
				ran.Add(1)
			}
			return nil
		}))
	tx, err := b.pool.Begin(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return w, tx
}

// work works a new job of args (inserted with opts) in tx and checks that it ended in want.
func work(t *testing.T, w *rivertest.Worker[callArgs, pgx.Tx], tx pgx.Tx, want river.EventKind, args callArgs,
	opts *river.InsertOpts, msgAndArgs ...any) *rivertest.WorkResult {
	t.Helper()
	res, err := w.Work(context.Background(), t, tx, args, opts)
	require.NoError(t, err)
	require.Equal(t, want, res.EventKind, msgAndArgs...)
	return res
}

// workAgain works job again in tx, as River brings it back, and checks that it ended in want.
func workAgain(t *testing.T, w *rivertest.Worker[callArgs, pgx.Tx], tx pgx.Tx, want river.EventKind,
	job *rivertype.JobRow, msgAndArgs ...any) *rivertest.WorkResult {
	t.Helper()
	res, err := w.WorkJob(context.Background(), t, tx, job)
	require.NoError(t, err)
	require.Equal(t, want, res.EventKind, msgAndArgs...)
	return res
}

// twoGates sets up limits a and b (1/minute, MaxReserved 10) on a clock the test moves (starting
// at t0), and a worker of callArgs jobs behind a Gate on a (outer) and one on b (inner); ran counts
// the runs of the job.
func twoGates(t *testing.T) (b *testBundle, clock *testClock, w *rivertest.Worker[callArgs, pgx.Tx], tx pgx.Tx,
	ran *atomic.Int32) {
	t.Helper()
	clock, ran = newTestClock(t0), new(atomic.Int32)
	b = setup(t, &setupOpts{
		limits: map[string]ratelimit.Config{
			"a": {Rate: 1, Period: time.Minute, MaxReserved: 10},
			"b": {Rate: 1, Period: time.Minute, MaxReserved: 10},
		},
		now: clock.Now,
	})
	gate := func(name string) *scheduler.Gate {
		g, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter,
			Limit: func(job *rivertype.JobRow) (scheduler.GateRequest, bool) {
				return scheduler.GateRequest{Name: name}, job.Kind == callArgs{}.Kind()
			}})
		require.NoError(t, err)
		scheduler.SetGateNow(g, clock.Now)
		return g
	}
	w, tx = gateWorker(t, b, ran, gate("a"), gate("b"))
	return b, clock, w, tx, ran
}

// TestGateTwoGatesPayOnceEach: a job behind two Gates pays each limit once. When the inner Gate
// (limit b) reserves and snoozes the job, the outer Gate's payment (limit a) stays recorded next
// to b's, so the job comes back paid for both. a and b are 1/minute: the job reserves a (due
// t0+1m), then b (due t0+2m), and at t0+2m runs, having taken one token of each. (b owes a token at
// t0, so that it is empty at t0+1m.)
func TestGateTwoGatesPayOnceEach(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b, clock, w, tx, ran := twoGates(t)
	// At t0, a is empty and b owes a token: b is empty again at t0+1m.
	for name, n := range map[string]float64{"a": 1, "b": 2} {
		res, err := b.limiter.LimitN(ctx, b.pool, name, "", n, &ratelimit.LimitOpts{Reserve: true})
		require.NoError(t, err)
		require.True(t, res.OK)
	}

	res := work(t, w, tx, river.EventKindJobSnoozed, callArgs{N: 1}, nil, "reserved on a, due t0+1m")
	clock.Set(t0.Add(time.Minute))
	res = workAgain(t, w, tx, river.EventKindJobSnoozed, res.Job, "a paid; reserved on b, due t0+2m")
	clock.Set(t0.Add(2 * time.Minute))
	for i := 0; res.EventKind == river.EventKindJobSnoozed; i++ {
		require.Less(t, i, 5, "the job never ran")
		var err error
		res, err = w.WorkJob(ctx, t, tx, res.Job)
		require.NoError(t, err)
	}
	require.Equal(t, river.EventKindJobCompleted, res.EventKind)
	require.Equal(t, int32(1), ran.Load())
	// Each limit refilled 2 tokens since t0 and paid 1 for the job: a has 1 left, b (which owed
	// one at t0) 0.
	st, err := b.limiter.State(ctx, tx, "b", "", nil)
	require.NoError(t, err)
	require.Equal(t, 0.0, st.Value, "b")
	st, err = b.limiter.State(ctx, tx, "a", "", nil)
	require.NoError(t, err)
	require.Equal(t, 1.0, st.Value, "a paid %g tokens for one run of the job", 2-st.Value)
}

// TestGateTwoGatesNested: the other ways through two Gates (a outer, b inner, 1/minute each).
// A job of ReserveTx runs through both on its reservation's payment, taking nothing; a job whose
// outer limit has its token takes it at once and, when the inner Gate reserves and snoozes it,
// comes back paid for a; a payment recorded by an earlier version (one Gate's, at the top level of
// "txlimit_paid") still counts for its own limit only.
func TestGateTwoGatesNested(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b, clock, w, tx, ran := twoGates(t)
	// The Gates decide on the pool, outside tx: tx takes no limit's row lock.
	r := reserve(t, b, "a", "", 1) // a job of ReserveTx, reserved on a
	require.Equal(t, 0.0, value(t, b, "a", ""))
	lr, err := b.limiter.LimitN(ctx, b.pool, "b", "", 2, &ratelimit.LimitOpts{Reserve: true}) // b owes one
	require.NoError(t, err)
	require.True(t, lr.OK)
	valueTx := func(name string) float64 {
		st, err := b.limiter.State(ctx, tx, name, "", nil)
		require.NoError(t, err)
		return st.Value
	}

	// The job of ReserveTx passes both Gates on its payment.
	workAgain(t, w, tx, river.EventKindJobCompleted, r.Job)
	require.Equal(t, int32(1), ran.Load())
	require.Equal(t, 0.0, valueTx("a"))
	require.Equal(t, -1.0, valueTx("b"), "b took nothing")

	// b, owing one at t0, is empty at t0+1m: a job takes a's token (refilled at t0+1m) at once,
	// then reserves on b (due t0+2m) and comes back paid for both.
	clock.Set(t0.Add(time.Minute))
	wr := work(t, w, tx, river.EventKindJobSnoozed, callArgs{N: 2}, nil)
	require.Equal(t, 0.0, valueTx("a"), "a's token taken")
	require.Equal(t, -1.0, valueTx("b"), "b reserved")
	clock.Set(t0.Add(3 * time.Minute))
	for i := 0; wr.EventKind == river.EventKindJobSnoozed; i++ {
		require.Less(t, i, 5, "the job never ran")
		wr, err = w.WorkJob(ctx, t, tx, wr.Job)
		require.NoError(t, err)
	}
	require.Equal(t, river.EventKindJobCompleted, wr.EventKind)
	require.Equal(t, int32(2), ran.Load())
	require.Equal(t, 1.0, valueTx("a"), "a paid once (full again at t0+3m)")
	require.Equal(t, 1.0, valueTx("b"))

	// An earlier version's payment of a (due now) lets the job past a; b charges.
	md := fmt.Sprintf(`{%q: {"attempt": 1, "due": %q, "name": "a", "key": ""}}`, scheduler.MetadataKey, clock.Now().Format(time.RFC3339Nano))
	work(t, w, tx, river.EventKindJobCompleted, callArgs{N: 3}, &river.InsertOpts{Metadata: []byte(md)})
	require.Equal(t, int32(3), ran.Load())
	require.Equal(t, 1.0, valueTx("a"))
	require.Equal(t, 0.0, valueTx("b"))
}

// TestGateDenialKeepsJitter: a denied job is snoozed until the RetryAt of the denial plus its
// jitter, then tries again, however many snoozes of at most MaxSnooze that takes: the Gate records
// the time and does not ask at an earlier wake-up. A denial due 4.4 s later, with the
// deterministic jitter JitterFor("a", 2s) = 1.02 s, does not take its token before RetryAt +
// 1.02 s. Before, the wait was cut to one MaxSnooze (4.5 s) and the job, asking again then, took
// its token 0.1 s after RetryAt, its jitter lost. The job is brought back after each snooze the
// Gate asks for, as River would bring it back.
func TestGateDenialKeepsJitter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	clock := newTestClock(t0)
	// One token per 4.4 s, capacity 1, no reservations: after the first job, one is denied 4.4 s.
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1, Period: 4400 * time.Millisecond}}, now: clock.Now})
	const jitterMax = 2 * time.Second
	j := scheduler.JitterFor("a", jitterMax)
	require.Greater(t, j, time.Second)
	gate, err := scheduler.NewGate(&scheduler.GateConfig{DB: b.pool, Limiter: b.limiter, Jitter: jitterMax,
		Limit: func(job *rivertype.JobRow) (scheduler.GateRequest, bool) {
			return scheduler.GateRequest{Name: "calls", JitterKey: "a"}, job.Kind == callArgs{}.Kind()
		}})
	require.NoError(t, err)
	scheduler.SetGateNow(gate, clock.Now)
	w, tx := gateWorker(t, b, nil, gate)

	work(t, w, tx, river.EventKindJobCompleted, callArgs{N: 1}, nil) // the one token

	retryAt := t0.Add(4400 * time.Millisecond)
	job := (*rivertype.JobRow)(nil)
	for i := 0; ; i++ {
		require.Less(t, i, 10, "the job never ran")
		before := time.Now()
		var res *rivertest.WorkResult
		var err error
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
		clock.Add(job.ScheduledAt.Sub(before)) // River brings it back after its snooze
	}
	require.False(t, clock.Now().Before(retryAt.Add(j)),
		"the denied job ran at RetryAt + %s, before RetryAt + its jitter %s: the jitter was cut to what fits in one MaxSnooze (%s)",
		clock.Now().Sub(retryAt), j, scheduler.MaxSnooze)
	require.Less(t, clock.Now().Sub(retryAt.Add(j)), 500*time.Millisecond, "and not much after")
}

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

// TestGateJobCancelWhileWaitingPaysOnce runs 40 jobs through a Gate over a limit that has 10
// tokens and never refills (the limiter's clock is frozen), so that 30 reserve and wait, while
// River's own JobCancel cancels every third job once it has been fetched and snoozed. Each job that
// ran ran once; each took its token once, counting a cancelled one's payment (docs/scheduler.md: a
// job cancelled while it waits keeps its tokens spent): the limit holds exactly 10 less the
// payments.
func TestGateJobCancelWhileWaitingPaysOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const n = 40
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": tenPerSecond}, now: frozen(t0), maxConns: 16})
	var ran sync.Map // job ID -> *atomic.Int32
	client := newClient(t, b.pool, &clientOpts{
		middleware: []rivertype.Middleware{callsGate(t, b, nil)},
		queues:     map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(20)},
		work: func(ctx context.Context, job *river.Job[callArgs]) error {
			c, _ := ran.LoadOrStore(job.ID, new(atomic.Int32))
			c.(*atomic.Int32).Add(1)
			return nil
		},
	})
	params := make([]river.InsertManyParams, n)
	for i := range params {
		params[i] = river.InsertManyParams{Args: callArgs{N: i}}
	}
	inserted, err := client.InsertMany(ctx, params)
	require.NoError(t, err)
	startClient(t, client)

	var wg sync.WaitGroup
	for i := 0; i < n; i += 3 {
		wg.Go(func() { // cancel the job once a Gate has let it wait (fetched, not running)
			id := inserted[i].Job.ID
			for deadline := time.Now().Add(60 * time.Second); ; {
				row, err := client.JobGet(ctx, id)
				switch {
				case err != nil:
					t.Error(err)
					return
				case time.Now().After(deadline):
					t.Errorf("job %d neither ran nor waited (%s)", id, row.State)
					return
				case row.State == rivertype.JobStateCompleted:
					return
				case row.State != rivertype.JobStateRunning && row.AttemptedAt != nil:
					if _, err := client.JobCancel(ctx, id); err != nil {
						t.Error(err)
					}
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	require.False(t, t.Failed())

	paid, cancelledPaid := 0, 0
	for _, ins := range inserted {
		var row *rivertype.JobRow
		require.Eventually(t, func() bool {
			row = jobRow(t, b, ins.Job.ID)
			return row.State == rivertype.JobStateCompleted || row.State == rivertype.JobStateCancelled
		}, 60*time.Second, 10*time.Millisecond, "job %d", ins.Job.ID)
		if c, ok := ran.Load(ins.Job.ID); ok {
			require.Equal(t, int32(1), c.(*atomic.Int32).Load(), "job %d ran more than once", ins.Job.ID)
			paid++
			continue
		}
		var md struct {
			Paid struct {
				Limits []struct {
					Name    string    `json:"name"`
					RetryAt time.Time `json:"retry_at"` // set on a denial: nothing paid
				} `json:"limits"`
			} `json:"txlimit_paid"`
		}
		require.NoError(t, jsonUnmarshal(row.Metadata, &md))
		for _, p := range md.Paid.Limits {
			if p.Name == "calls" && p.RetryAt.IsZero() {
				paid++
				cancelledPaid++
			}
		}
	}
	require.Positive(t, cancelledPaid, "no job was cancelled while it waited paid: the test tests nothing")
	require.Equal(t, 10-float64(paid), value(t, b, "calls", ""))
	t.Logf("%d payments, %d of cancelled jobs", paid, cancelledPaid)
}
