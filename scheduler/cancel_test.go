package scheduler_test

import (
	"context"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// tenPerSecond is a bucket of 10 tokens per second (one every 100 ms), capacity 10.
var tenPerSecond = ratelimit.Config{Rate: 10, Period: time.Second, MaxReserved: 1000}

// reserve commits a ReserveTx and returns its job.
func reserve(t *testing.T, b *testBundle, name, key string, count float64) *scheduler.Reservation {
	t.Helper()
	var res *scheduler.Reservation
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		var err error
		res, err = b.sched.ReserveTx(context.Background(), tx, name, key, count, callArgs{}, nil)
		return err
	}))
	return res
}

func TestCancelTx(t *testing.T) { direct(t, cancelTx) }

func cancelTx(t *testing.T, c conn) {
	ctx := context.Background()
	b := setupCalls(t, tenPerSecond, c)

	reserve(t, b, "calls", "u1", 10)      // runs now: the bucket is empty
	jb := reserve(t, b, "calls", "u1", 5) // waits 500 ms
	jc := reserve(t, b, "calls", "u1", 5) // waits 1 s
	require.Equal(t, t0.Add(500*time.Millisecond), jb.ScheduledAt.UTC())
	require.Equal(t, t0.Add(time.Second), jc.ScheduledAt.UTC())
	require.Equal(t, -10.0, value(t, b, "calls", "u1"))

	// A cancel rolled back leaves the job, the tokens and the other job's time as they were.
	require.NoError(t, inTx(t, b.pool, true, func(tx pgx.Tx) error {
		res, err := b.sched.CancelTx(ctx, tx, jb.Job.ID)
		require.NoError(t, err)
		require.Equal(t, rivertype.JobStateCancelled, res.Job.State)
		return nil
	}))
	require.Equal(t, rivertype.JobStateAvailable, jobRow(t, b, jb.Job.ID).State)
	require.Equal(t, -10.0, value(t, b, "calls", "u1"))
	require.Equal(t, t0.Add(time.Second), jobRow(t, b, jc.Job.ID).ScheduledAt.UTC())

	// Committed: job b is cancelled, its 5 tokens come back, and job c, which waited behind them,
	// is due 500 ms earlier.
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := b.sched.CancelTx(ctx, tx, jb.Job.ID)
		require.NoError(t, err)
		require.Equal(t, []scheduler.SettledLimit{{Name: "calls", Key: "u1", Reserved: 5, Credited: 5}}, res.Limits)
		require.Equal(t, 1, res.PulledForward)
		return nil
	}))
	require.Equal(t, rivertype.JobStateCancelled, jobRow(t, b, jb.Job.ID).State)
	require.Equal(t, -5.0, value(t, b, "calls", "u1"))
	require.Equal(t, t0.Add(500*time.Millisecond), jobRow(t, b, jc.Job.ID).ScheduledAt.UTC())

	// A second cancel is refused and writes nothing; so is a cancel or a settle of an unknown job.
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		_, err := b.sched.CancelTx(ctx, tx, jb.Job.ID)
		var nc *scheduler.NotCancellableError
		require.ErrorAs(t, err, &nc)
		require.ErrorIs(t, err, scheduler.ErrNotCancellable)
		require.True(t, nc.Cancelled())
		_, err = b.sched.CancelTx(ctx, tx, 1<<40)
		require.ErrorIs(t, err, rivertype.ErrNotFound)
		_, err = b.sched.SettleTx(ctx, tx, 1<<40, 1)
		require.ErrorIs(t, err, rivertype.ErrNotFound)
		return nil // the transaction is still usable
	}))
	require.Equal(t, -5.0, value(t, b, "calls", "u1"))

	// A settle after the cancel returns the cancel's refund and changes nothing; a cancel after a
	// settle is refused.
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		out, err := b.sched.SettleTx(ctx, tx, jb.Job.ID, 1)
		require.NoError(t, err)
		require.True(t, out.Repeated)
		require.True(t, out.Cancelled)
		require.Equal(t, []scheduler.SettledLimit{{Name: "calls", Key: "u1", Reserved: 5, Credited: 5}}, out.Limits)
		_, err = b.sched.SettleTx(ctx, tx, jc.Job.ID, 5)
		require.NoError(t, err)
		_, err = b.sched.CancelTx(ctx, tx, jc.Job.ID)
		var nc *scheduler.NotCancellableError
		require.ErrorAs(t, err, &nc)
		require.True(t, nc.Settled)
		return nil
	}))
	require.Equal(t, -5.0, value(t, b, "calls", "u1"))

	// A job River inserted without ReserveTx has nothing to refund.
	plain, err := b.client.Insert(ctx, callArgs{}, nil)
	require.NoError(t, err)
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		_, err := b.sched.CancelTx(ctx, tx, plain.Job.ID)
		require.ErrorIs(t, err, scheduler.ErrNotReserved)
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
		return nil
	}))
	require.Equal(t, rivertype.JobStateAvailable, jobRow(t, b, plain.Job.ID).State)
}

func TestCancelTxManyLimits(t *testing.T) { direct(t, cancelTxManyLimits) }

func cancelTxManyLimits(t *testing.T, c conn) {
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{
		"calls":  {Rate: 2, Period: time.Second, MaxReserved: 100},
		"tokens": {Rate: 1000, Period: time.Second, MaxReserved: 100_000},
	}, now: frozen(t0), conn: c})
	var res *scheduler.Reservation
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		var err error
		res, err = b.sched.ReserveManyTx(ctx, tx, []ratelimit.Request{
			{Name: "calls", Key: "org", Count: 1}, {Name: "tokens", Key: "org", Count: 3000},
		}, callArgs{}, nil)
		return err
	}))
	require.Equal(t, t0.Add(2*time.Second), res.ScheduledAt.UTC())
	require.Equal(t, 1.0, value(t, b, "calls", "org"))
	require.Equal(t, -2000.0, value(t, b, "tokens", "org"))

	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		c, err := b.sched.CancelTx(ctx, tx, res.Job.ID)
		require.NoError(t, err)
		require.Equal(t, []scheduler.SettledLimit{
			{Name: "calls", Key: "org", Reserved: 1, Credited: 1},
			{Name: "tokens", Key: "org", Reserved: 3000, Credited: 3000},
		}, c.Limits)
		return nil
	}))
	require.Equal(t, 2.0, value(t, b, "calls", "org"))
	require.Equal(t, 1000.0, value(t, b, "tokens", "org"))
}

// TestCancelTxStartedJob runs a job with River: while it runs and after it ran, CancelTx refuses
// it, refunds nothing and leaves River's state alone (no cancellation is requested).
func TestCancelTxStartedJob(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1, Period: time.Hour, Capacity: 100, MaxReserved: 100}}})
	started, release := make(chan int64, 1), make(chan struct{})
	worker := newClient(t, b.pool, &clientOpts{
		queues: map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(2)},
		work: func(ctx context.Context, job *river.Job[callArgs]) error {
			started <- job.ID
			<-release
			return nil
		},
	})
	sched, err := scheduler.New(worker, b.limiter, nil)
	require.NoError(t, err)
	events, cancelSub := worker.Subscribe(river.EventKindJobCompleted)
	defer cancelSub()
	startClient(t, worker)

	res := reserve(t, b, "calls", "u1", 3)
	select {
	case id := <-started:
		require.Equal(t, res.Job.ID, id)
	case <-time.After(30 * time.Second):
		t.Fatal("the job did not start")
	}
	refused := func(wantState rivertype.JobState) {
		t.Helper()
		before := value(t, b, "calls", "u1")
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			_, err := sched.CancelTx(ctx, tx, res.Job.ID)
			var nc *scheduler.NotCancellableError
			require.ErrorAs(t, err, &nc)
			require.Equal(t, wantState, nc.State)
			require.True(t, nc.Started)
			return nil
		}))
		require.InDelta(t, before, value(t, b, "calls", "u1"), 0.01) // refill only
	}
	refused(rivertype.JobStateRunning)
	_, asked := metadataMap(t, jobRow(t, b, res.Job.ID).Metadata)["cancel_attempted_at"]
	require.False(t, asked, "River was asked to cancel the running job")
	close(release)
	select {
	case <-events:
	case <-time.After(30 * time.Second):
		t.Fatal("the job did not complete")
	}
	refused(rivertype.JobStateCompleted)
}

func metadataMap(t *testing.T, md []byte) map[string]any {
	t.Helper()
	m := map[string]any{}
	require.NoError(t, jsonUnmarshal(md, &m))
	return m
}

// TestSettleTxOnce settles one job from 16 transactions at once: the 8 unused tokens are credited
// once, every call returns the same outcome, and exactly one of them did it.
func TestSettleTxOnce(t *testing.T) { direct(t, settleTxOnce) }

func settleTxOnce(t *testing.T, c conn) {
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": tenPerSecond}, now: frozen(t0), maxConns: 20, conn: c})
	reserve(t, b, "calls", "u1", 10)
	res := reserve(t, b, "calls", "u1", 10) // owes 10
	require.Equal(t, -10.0, value(t, b, "calls", "u1"))

	const n = 16
	outs := make([]*scheduler.JobSettlement, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			tx, err := b.pool.Begin(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			defer tx.Rollback(ctx) //nolint:errcheck // after Commit
			out, err := b.sched.SettleTx(ctx, tx, res.Job.ID, 2)
			if err == nil {
				err = tx.Commit(ctx)
			}
			if err != nil {
				t.Error(err)
				return
			}
			outs[i] = out
		})
	}
	close(start)
	wg.Wait()
	require.False(t, t.Failed())
	first := 0
	for _, out := range outs {
		if !out.Repeated {
			first++
		}
		require.Equal(t, []scheduler.SettledLimit{{Name: "calls", Key: "u1", Reserved: 10, Actual: 2, Credited: 8}}, out.Limits)
	}
	require.Equal(t, 1, first)
	require.Equal(t, -2.0, value(t, b, "calls", "u1"))

	// A settle rolled back is undone with its credit: the next one settles.
	res2 := reserve(t, b, "calls", "u1", 4)
	require.NoError(t, inTx(t, b.pool, true, func(tx pgx.Tx) error {
		_, err := b.sched.SettleTx(ctx, tx, res2.Job.ID, 0)
		return err
	}))
	require.Equal(t, -6.0, value(t, b, "calls", "u1"))
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		out, err := b.sched.SettleTx(ctx, tx, res2.Job.ID, 6) // an overrun of 2
		require.NoError(t, err)
		require.False(t, out.Repeated)
		require.Equal(t, 2.0, out.Limits[0].Charged)
		return nil
	}))
	require.Equal(t, -8.0, value(t, b, "calls", "u1"))

	// Bad input writes nothing.
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		_, err := b.sched.SettleTx(ctx, tx, res2.Job.ID, -1)
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
		_, err = b.sched.SettleManyTx(ctx, tx, res.Job.ID, []float64{1, 2})
		require.NoError(t, err, "a settled job answers with its settlement whatever is asked")
		res3 := reserve(t, b, "calls", "u1", 1)
		_, err = b.sched.SettleManyTx(ctx, tx, res3.Job.ID, []float64{1, 2})
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
		return nil
	}))
}

// TestSettleTxRetried runs a job with River whose first attempt settles (committed) and then
// fails; River retries it and the retry's settle changes nothing.
func TestSettleTxRetried(t *testing.T) {
	t.Parallel()
	// One token an hour: the refill during the test is under 0.01 of a token.
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1, Period: time.Hour, Capacity: 100, MaxReserved: 100}}})
	type attempt struct {
		n   int
		out *scheduler.JobSettlement
	}
	attempts := make(chan attempt, 4)
	var sched *scheduler.Scheduler
	worker := newClient(t, b.pool, &clientOpts{
		queues: map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(2)},
		work: func(ctx context.Context, job *river.Job[callArgs]) error {
			var out *scheduler.JobSettlement
			err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
				var err error
				out, err = sched.SettleTx(ctx, tx, job.ID, 1)
				return err
			})
			if err != nil {
				return err
			}
			attempts <- attempt{n: job.Attempt, out: out}
			if job.Attempt == 1 {
				return errors.New("fail after settling")
			}
			return nil
		},
		retryPolicy: retryAfter(10 * time.Millisecond),
	})
	var err error
	sched, err = scheduler.New(worker, b.limiter, nil)
	require.NoError(t, err)
	startClient(t, worker)

	reserve(t, b, "calls", "u1", 6)
	for want := 1; want <= 2; want++ {
		select {
		case a := <-attempts:
			require.Equal(t, want, a.n)
			require.Equal(t, want == 2, a.out.Repeated)
			require.Equal(t, 5.0, a.out.Limits[0].Credited)
		case <-time.After(60 * time.Second):
			t.Fatalf("attempt %d did not run", want)
		}
	}
	// 100 - 6 + 5 once (a second credit would have filled it to 100).
	require.InDelta(t, 99.0, value(t, b, "calls", "u1"), 0.01)
}

// retryPolicy retries after a fixed delay.
type retryPolicy struct{ d time.Duration }

func (p retryPolicy) NextRetry(*rivertype.JobRow) time.Time { return time.Now().Add(p.d) }

func retryAfter(d time.Duration) river.ClientRetryPolicy { return retryPolicy{d: d} }

func TestSettle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := ratelimit.Config{Rate: 100, Period: time.Minute, MaxReserved: 50}
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"tokens": cfg}, now: frozen(t0)})
	take := func(n float64) {
		t.Helper()
		res, err := b.limiter.LimitN(ctx, b.pool, "tokens", "k", n, &ratelimit.LimitOpts{Reserve: true})
		if err == nil {
			err = res.Err()
		}
		require.NoError(t, err)
	}

	steps := []struct {
		take, reserved, actual float64
		charged, credited      float64
		value                  float64
	}{
		{take: 80, reserved: 80, actual: 50, credited: 30, value: 50},  // unused part back
		{take: 30, reserved: 30, actual: 30, value: 20},                // exact: nothing written
		{take: 60, reserved: 60, actual: 70, charged: 10, value: -50},  // overrun within MaxReserved
		{take: 0, reserved: 0, actual: 25, charged: 25, value: -75},    // past MaxReserved: booked anyway
		{take: 0, reserved: 500, actual: 0, credited: 175, value: 100}, // never above capacity
	}
	for i, s := range steps {
		if s.take > 0 {
			take(s.take)
		}
		got, err := scheduler.Settlement{Name: "tokens", Key: "k", Reserved: s.reserved}.Settle(ctx, b.pool, b.limiter, s.actual, nil)
		require.NoError(t, err, "step %d", i)
		want := scheduler.SettledLimit{Name: "tokens", Key: "k", Reserved: s.reserved, Actual: s.actual, Charged: s.charged, Credited: s.credited}
		require.Equal(t, want, got, "step %d", i)
		require.Equal(t, s.value, value(t, b, "tokens", "k"), "step %d", i)
	}

	// An inline config, unknown to the limiter, is used as given, for the forced overrun too.
	inline := &ratelimit.Config{Rate: 10, Period: time.Minute, MaxReserved: 1}
	_, err := scheduler.Settlement{Name: "inline", Reserved: 1}.Settle(ctx, b.pool, b.limiter, 20, &ratelimit.LimitOpts{Config: inline})
	require.NoError(t, err)
	st, err := b.limiter.State(ctx, b.pool, "inline", "", &ratelimit.LimitOpts{Config: inline})
	require.NoError(t, err)
	require.Equal(t, -9.0, st.Value)

	for _, actual := range []float64{-1, math.NaN(), math.Inf(1)} {
		_, err := scheduler.Settlement{Name: "tokens", Reserved: 1}.Settle(ctx, b.pool, b.limiter, actual, nil)
		require.ErrorIs(t, err, ratelimit.ErrInvalid, "actual %g", actual)
	}
}

// TestSettlementEndToEnd: calls reserve their estimates, River runs them, each settles its
// reservation with its actual usage in the transaction that completes it; then the limit holds
// exactly capacity minus the actual usage.
func TestSettlementEndToEnd(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const n = 20
	// Frozen clock: no refill, so the expected value is exact. MaxReserved is tight enough that
	// some overruns are booked past it.
	cfg := ratelimit.Config{Rate: 2000, Period: time.Minute, MaxReserved: 1950}
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"tokens": cfg}, now: frozen(t0), maxConns: 16})
	estimate := func(i int) float64 { return float64(100 + 10*i) }
	actual := func(i int) float64 { // a third overrun by 25, the rest use 60%
		if i%3 == 0 {
			return estimate(i) + 25
		}
		return estimate(i) * 0.6
	}
	var settled atomic.Int32
	done := make(chan struct{}, n)
	client := newClient(t, b.pool, &clientOpts{
		queues: map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(8)},
		work: func(ctx context.Context, job *river.Job[callArgs]) error {
			tx, err := b.pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx) //nolint:errcheck
			if _, err := job.Args.Budget.Settle(ctx, tx, b.limiter, actual(job.Args.N), nil); err != nil {
				return err
			}
			if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
				return err
			}
			if err := tx.Commit(ctx); err != nil {
				return err
			}
			settled.Add(1)
			done <- struct{}{}
			return nil
		},
	})
	sched, err := scheduler.New(client, b.limiter, nil)
	require.NoError(t, err)
	startClient(t, client)

	var want float64 = 2000
	for i := range n {
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			budget := scheduler.Settlement{Name: "tokens", Key: "org", Reserved: estimate(i)}
			_, err := sched.ReserveTx(ctx, tx, budget.Name, budget.Key, budget.Reserved, callArgs{N: i, Budget: budget}, nil)
			return err
		}))
		want -= actual(i)
	}
	timeout := time.After(30 * time.Second)
	for range n {
		select {
		case <-done:
		case <-timeout:
			t.Fatalf("only %d of %d jobs settled", settled.Load(), n)
		}
	}
	require.Equal(t, want, value(t, b, "tokens", "org"))
}
