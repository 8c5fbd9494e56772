package scheduler_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
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

func TestCancelTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, tenPerSecond)

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

func TestCancelTxManyLimits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{
		"calls":  {Rate: 2, Period: time.Second, MaxReserved: 100},
		"tokens": {Rate: 1000, Period: time.Second, MaxReserved: 100_000},
	}, now: frozen(t0)})
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
func TestSettleTxOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": tenPerSecond}, now: frozen(t0), maxConns: 20})
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

// The model of pull-forward: a limit is a ledger of operations in order, reservations and credits.
// A job's tokens of a limit have accrued at the earliest instant, from its reservation on, at which
// the level of the limit, counting every operation up to the job's reservation and every later
// credit out of the reservation of the job itself or of one before it, but no later reservation,
// is >= 0. Credits are what the limit really took (it never goes above capacity). The job is due when all its limits have accrued.

type mOp struct {
	at       time.Time
	job      int     // the reserving job, -1 for a credit
	from     int     // a credit's job: the one cancelled or settled
	count    float64 // reserved, or asked to credit
	credited float64 // a credit's amount as the limit took it
}

type mLimit struct {
	cfg ratelimit.Config // capacity = Rate; a fixed window starts at t0
	ops []mOp
}

// refill returns level after the time from..to.
func (l *mLimit) refill(level float64, from, to time.Time) float64 {
	if !to.After(from) {
		return level
	}
	if l.cfg.Kind == ratelimit.FixedWindow {
		n := float64(to.Sub(t0)/l.cfg.Period - from.Sub(t0)/l.cfg.Period) // window starts in (from, to]
		return math.Min(level+n*l.cfg.Rate, l.cfg.Rate)
	}
	return math.Min(level+l.cfg.Rate*float64(to.Sub(from))/float64(l.cfg.Period), l.cfg.Rate)
}

// add appends an operation and, for a credit, computes what the limit takes of it.
func (l *mLimit) add(op mOp) float64 {
	if op.job < 0 {
		level, at := l.cfg.Rate, t0
		for _, o := range l.ops {
			level, at = l.apply(level, at, o)
		}
		level = l.refill(level, at, op.at)
		op.credited = math.Min(level+op.count, l.cfg.Rate) - level
	}
	l.ops = append(l.ops, op)
	return op.credited
}

// apply is the ledger after o: the level refilled from at to o.at, then charged o's reservation
// or given its credit.
func (l *mLimit) apply(level float64, at time.Time, o mOp) (float64, time.Time) {
	level = l.refill(level, at, o.at)
	if o.job >= 0 {
		return level - o.count, o.at
	}
	return level + o.credited, o.at
}

// earliest returns when job's tokens of l have accrued, and whether it had to wait for them.
func (l *mLimit) earliest(job int) (time.Time, bool) {
	level, at := l.cfg.Rate, t0
	i := 0
	for ; i < len(l.ops); i++ { // the ledger as it was, up to the job's reservation
		o := l.ops[i]
		level, at = l.apply(level, at, o)
		if o.job == job {
			break
		}
	}
	if i == len(l.ops) {
		panic("job not in ledger")
	}
	if level >= 0 {
		return at, false
	}
	cross := func(until time.Time, bounded bool) (time.Time, bool) { // first instant in (at, until] with level >= 0
		if l.cfg.Kind == ratelimit.FixedWindow {
			for b := t0.Add((at.Sub(t0)/l.cfg.Period + 1) * l.cfg.Period); !bounded || !b.After(until); b = b.Add(l.cfg.Period) {
				if l.refill(level, at, b) >= 0 {
					return b, true
				}
				if !bounded && b.Sub(at) > time.Hour {
					panic("no crossing")
				}
			}
			return time.Time{}, false
		}
		t := at.Add(time.Duration(math.Ceil(-level*float64(l.cfg.Period)/l.cfg.Rate/1e3)) * time.Microsecond)
		return t, !bounded || !t.After(until)
	}
	for _, o := range l.ops[i+1:] {
		if o.job >= 0 || o.from > job {
			continue // later reservations wait behind the job, and their refunds do not help it
		}
		if t, ok := cross(o.at, true); ok {
			return t, true
		}
		level = l.refill(level, at, o.at) + o.credited
		at = o.at
		if level >= 0 {
			return at, true
		}
	}
	t, _ := cross(time.Time{}, false)
	return t, true
}

type mJob struct {
	id        int64
	limits    []string
	counts    []float64
	waited    bool
	cancelled bool
	settled   bool
}

// TestPullForwardModel runs random reservations (one limit and two), cancels, settles and clock
// steps on a token bucket, a second token bucket and a fixed window, and after each step compares
// the scheduled time of every waiting job with the model's earliest time for it, exactly.
func TestPullForwardModel(t *testing.T) {
	t.Parallel()
	for _, seed := range []uint64{1, 3, 5, 15} { // each a different history; seed 1 found a lost fixed-window credit
		t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
			t.Parallel()
			pullForwardModel(t, seed)
		})
	}
}

func pullForwardModel(t *testing.T, seed uint64) {
	ctx := context.Background()
	limits := map[string]*mLimit{
		"tok": {cfg: ratelimit.Config{Rate: 10, Period: time.Second, MaxReserved: 1000}},
		"req": {cfg: ratelimit.Config{Rate: 2, Period: time.Second, MaxReserved: 1000}},
		"win": {cfg: ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 10, Period: time.Second, Start: t0, MaxReserved: 1000}},
	}
	cfgs := map[string]ratelimit.Config{}
	for name, l := range limits {
		cfgs[name] = l.cfg
	}
	clock := newTestClock(t0)
	b := setup(t, &setupOpts{limits: cfgs, now: clock.Now})
	rng := rand.New(rand.NewPCG(seed, 6))

	var js []*mJob
	check := func(step int) {
		t.Helper()
		for i, j := range js {
			if j.cancelled || !j.waited {
				continue
			}
			var want time.Time
			for _, name := range j.limits {
				if at, _ := limits[name].earliest(i); at.After(want) {
					want = at
				}
			}
			require.Equal(t, want, jobRow(t, b, j.id).ScheduledAt.UTC(), "step %d: job %d (%v %v)", step, i, j.limits, j.counts)
		}
	}
	live := func() *mJob {
		var c []*mJob
		for _, j := range js {
			if !j.cancelled && !j.settled {
				c = append(c, j)
			}
		}
		if len(c) == 0 {
			return nil
		}
		return c[rng.IntN(len(c))]
	}
	index := func(j *mJob) int {
		for i := range js {
			if js[i] == j {
				return i
			}
		}
		panic("unknown job")
	}
	moved := 0
	for step := range 120 {
		switch p := rng.IntN(100); {
		case p < 45:
			j := &mJob{limits: []string{"tok"}, counts: []float64{float64(1 + rng.IntN(8))}}
			switch {
			case p < 15:
				j.limits, j.counts = []string{"tok", "req"}, []float64{j.counts[0], 1}
			case p < 27:
				j.limits, j.counts = []string{"win"}, []float64{float64(1 + rng.IntN(12))}
			}
			reqs := make([]ratelimit.Request, len(j.limits))
			for i := range reqs {
				reqs[i] = ratelimit.Request{Name: j.limits[i], Key: "k", Count: j.counts[i]}
			}
			require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
				res, err := b.sched.ReserveManyTx(ctx, tx, reqs, callArgs{N: len(js)}, nil)
				if err != nil {
					return err
				}
				j.id, j.waited = res.Job.ID, !res.RetryAt.IsZero()
				return nil
			}))
			for i, name := range j.limits {
				limits[name].add(mOp{at: clock.Now(), job: len(js), count: j.counts[i]})
			}
			js = append(js, j)
		case p < 65:
			j := live()
			if j == nil {
				continue
			}
			require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
				res, err := b.sched.CancelTx(ctx, tx, j.id)
				require.NoError(t, err)
				for i, name := range j.limits {
					want := limits[name].add(mOp{at: clock.Now(), job: -1, from: index(j), count: j.counts[i]})
					require.Equal(t, want, res.Limits[i].Credited, "step %d: refund of %s", step, name)
				}
				moved += res.PulledForward
				return nil
			}))
			j.cancelled = true
		case p < 85:
			j := live()
			if j == nil {
				continue
			}
			actual := make([]float64, len(j.counts))
			for i, c := range j.counts {
				actual[i] = math.Floor(c / 2)
			}
			require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
				res, err := b.sched.SettleManyTx(ctx, tx, j.id, actual)
				require.NoError(t, err)
				for i, name := range j.limits {
					want := limits[name].add(mOp{at: clock.Now(), job: -1, from: index(j), count: j.counts[i] - actual[i]})
					require.Equal(t, want, res.Limits[i].Credited, "step %d: credit of %s", step, name)
				}
				moved += res.PulledForward
				return nil
			}))
			j.settled = true
		default:
			clock.Add(time.Duration(1+rng.IntN(5)) * 100 * time.Millisecond)
		}
		check(step)
	}
	require.Positive(t, moved, "no job was pulled forward: the test tests nothing")
	t.Logf("%d jobs, %d pulled forward", len(js), moved)
}

// TestPullForwardRecordsRow: a waiting job records, per limit, its RetryAt and the row its
// reservation left (value, ts); a credit out of an earlier reservation is added to that row and the
// RetryAt follows it, also a fixed window's credit too small to move the job by a window (recorded,
// so that the next credit adds to it). A sharded limit is recorded as fixed, with no row.
func TestPullForwardRecordsRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{
		"tok": {Rate: 10, Period: time.Second, MaxReserved: 1000},
		"win": {Kind: ratelimit.FixedWindow, Rate: 5, Period: 10 * time.Second, Start: t0, MaxReserved: 1000},
		"hot": {Rate: 10, Period: time.Second, Shards: 2, MaxReserved: 1000},
	}, now: frozen(t0)})
	reserved := func(id int64) string {
		return string(metadataValue(t, jobRow(t, b, id).Metadata, scheduler.ReservedKey))
	}
	cancel := func(id int64, moved int) {
		t.Helper()
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			res, err := b.sched.CancelTx(ctx, tx, id)
			require.NoError(t, err)
			require.Equal(t, moved, res.PulledForward)
			return nil
		}))
	}

	reserve(t, b, "tok", "k", 10) // runs now
	ja := reserve(t, b, "tok", "k", 5)
	jb := reserve(t, b, "tok", "k", 5)
	require.JSONEq(t, `{"limits":[{"name":"tok","key":"k","count":5,"retry_at":"2024-01-01T12:00:01Z",
		"row":{"value":-10,"ts":"2024-01-01T12:00:00Z"}}]}`, reserved(jb.Job.ID))
	cancel(ja.Job.ID, 1)
	require.JSONEq(t, `{"limits":[{"name":"tok","key":"k","count":5,"retry_at":"2024-01-01T12:00:00.5Z",
		"row":{"value":-5,"ts":"2024-01-01T12:00:00Z"}}]}`, reserved(jb.Job.ID))
	require.Equal(t, t0.Add(500*time.Millisecond), jobRow(t, b, jb.Job.ID).ScheduledAt.UTC())

	reserve(t, b, "win", "k", 5) // runs now: the window of t0 is empty
	jc := reserve(t, b, "win", "k", 0.25)
	jd := reserve(t, b, "win", "k", 0.25)
	je := reserve(t, b, "win", "k", 10) // −10.5: three windows
	require.JSONEq(t, `{"limits":[{"name":"win","key":"k","count":10,"retry_at":"2024-01-01T12:00:30Z",
		"row":{"value":-10.5,"ts":"2024-01-01T12:00:00Z"}}]}`, reserved(je.Job.ID))
	cancel(jc.Job.ID, 0) // −10.25: still three windows, but recorded
	require.JSONEq(t, `{"limits":[{"name":"win","key":"k","count":10,"retry_at":"2024-01-01T12:00:30Z",
		"row":{"value":-10.25,"ts":"2024-01-01T12:00:00Z"}}]}`, reserved(je.Job.ID))
	cancel(jd.Job.ID, 1) // −10.25 + 0.25 = −10: two windows
	require.JSONEq(t, `{"limits":[{"name":"win","key":"k","count":10,"retry_at":"2024-01-01T12:00:20Z",
		"row":{"value":-10,"ts":"2024-01-01T12:00:00Z"}}]}`, reserved(je.Job.ID))
	require.Equal(t, t0.Add(20*time.Second), jobRow(t, b, je.Job.ID).ScheduledAt.UTC())

	reserve(t, b, "hot", "k", 10)
	jf := reserve(t, b, "hot", "k", 4) // both shards at −2, 5/s each
	require.JSONEq(t, `{"limits":[{"name":"hot","key":"k","count":4,"retry_at":"2024-01-01T12:00:00.4Z","fixed":true}]}`, reserved(jf.Job.ID))
}

// TestPullForwardDocExample runs the worked example of docs/scheduler.md ("Credits pull waiting
// work forward"): a 10/s bucket emptied at 12:00:00, a job that reserved 5 more records the row
// (−5, 12:00:00) and 12:00:00.5; a credit of 2 at 12:00:00.1 out of the earlier reservation makes
// them (−3, 12:00:00) and 12:00:00.3, max(RetryAt − c/r, now). The example's key, u1, and keys
// that the JSON of the waiting jobs' filter and of the rescheduled reservations (a text array, in
// the exec and simple-protocol modes an array literal) must escape or quote.
func TestPullForwardDocExample(t *testing.T) {
	t.Parallel()
	for _, key := range []string{"u1", `we"ird, {key}\ é NULL`, "NULL", "  padded ", `'; DROP TABLE river_job; --`, `\`, ""} {
		t.Run(fmt.Sprintf("%q", key), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			var now atomic.Int64
			now.Store(t0.UnixMicro())
			b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": tenPerSecond},
				now: func() time.Time { return time.UnixMicro(now.Load()).UTC() }})
			k, err := json.Marshal(key)
			require.NoError(t, err)
			ja := reserve(t, b, "calls", key, 10) // runs now: the bucket is emptied
			require.True(t, ja.RetryAt.IsZero())
			jb := reserve(t, b, "calls", key, 5)
			require.JSONEq(t, `{"limits":[{"name":"calls","key":`+string(k)+`,"count":5,"retry_at":"2024-01-01T12:00:00.5Z",
				"row":{"value":-5,"ts":"2024-01-01T12:00:00Z"}}]}`, string(metadataValue(t, jobRow(t, b, jb.Job.ID).Metadata, scheduler.ReservedKey)))

			now.Store(t0.Add(100 * time.Millisecond).UnixMicro())
			require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
				res, err := b.sched.SettleTx(ctx, tx, ja.Job.ID, 8) // 2 of the 10 back
				require.NoError(t, err)
				require.Equal(t, 1, res.PulledForward)
				require.Equal(t, 2.0, res.Limits[0].Credited)
				return nil
			}))
			require.JSONEq(t, `{"limits":[{"name":"calls","key":`+string(k)+`,"count":5,"retry_at":"2024-01-01T12:00:00.3Z",
				"row":{"value":-3,"ts":"2024-01-01T12:00:00Z"}}]}`, string(metadataValue(t, jobRow(t, b, jb.Job.ID).Metadata, scheduler.ReservedKey)))
			require.Equal(t, t0.Add(300*time.Millisecond), jobRow(t, b, jb.Job.ID).ScheduledAt.UTC())
		})
	}
}

// TestPullForwardKeepsJitterAndNotBefore: a job pulled forward is due at max(RetryAt + Jitter,
// NotBefore) (docs/scheduler.md): it keeps its jitter, and never moves before the InsertOpts
// ScheduledAt its caller asked for. A refund of 10 at t0 makes both jobs' tokens there at once.
func TestPullForwardKeepsJitterAndNotBefore(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, tenPerSecond)
	reserveWith := func(opts *scheduler.ReserveOpts) *scheduler.Reservation {
		t.Helper()
		var res *scheduler.Reservation
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			var err error
			res, err = b.sched.ReserveTx(ctx, tx, "calls", "u1", 5, callArgs{}, opts)
			return err
		}))
		return res
	}
	ja := reserve(t, b, "calls", "u1", 10) // runs now: the bucket is emptied
	jitter := scheduler.JitterFor("u1", 40*time.Millisecond)
	require.Positive(t, jitter)
	jb := reserveWith(&scheduler.ReserveOpts{Jitter: 40 * time.Millisecond, JitterKey: "u1"})
	require.Equal(t, t0.Add(500*time.Millisecond+jitter), jb.ScheduledAt.UTC())
	notBefore := t0.Add(900 * time.Millisecond)
	jc := reserveWith(&scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{ScheduledAt: notBefore}})
	require.Equal(t, t0.Add(time.Second), jc.ScheduledAt.UTC())

	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := b.sched.CancelTx(ctx, tx, ja.Job.ID)
		require.NoError(t, err)
		require.Equal(t, 2, res.PulledForward)
		return nil
	}))
	require.Equal(t, t0.Add(jitter), jobRow(t, b, jb.Job.ID).ScheduledAt.UTC(), "the jitter is kept")
	require.Equal(t, notBefore, jobRow(t, b, jc.Job.ID).ScheduledAt.UTC(), "never before NotBefore")
}

// TestPullForwardShardedKeepsTime: a credit to a sharded limit does not move the jobs waiting on it
// (it goes to the emptiest shards, not necessarily theirs): they keep their time, never earlier.
func TestPullForwardShardedKeepsTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{
		"hot": {Rate: 10, Period: time.Second, Shards: 2, MaxReserved: 1000},
	}, now: frozen(t0)})
	reserve(t, b, "hot", "k", 10)
	r1 := reserve(t, b, "hot", "k", 4)
	r2 := reserve(t, b, "hot", "k", 4)
	before := jobRow(t, b, r2.Job.ID).ScheduledAt
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		res, err := b.sched.CancelTx(ctx, tx, r1.Job.ID)
		require.NoError(t, err)
		require.Equal(t, 0, res.PulledForward)
		return nil
	}))
	require.Equal(t, before, jobRow(t, b, r2.Job.ID).ScheduledAt)
	_ = scheduler.ReservedKey
}

// TestCancelTxRetriedJobPaysAgain: CancelTx refunds every token a job of ReserveTx reserved and
// removes the job's payment for its first attempt ("txlimit_paid": {"attempt": 1}). A cancelled
// job brought back with River's JobRetry (River UI's Retry) then pays at the Gate over its kind;
// before, it ran as paid for by the refunded reservation and the limit over-granted by the whole
// job.
func TestCancelTxRetriedJobPaysAgain(t *testing.T) {
	t.Parallel()
	refundedJobRetriedPaysAgain(t, func(ctx context.Context, b *testBundle, tx pgx.Tx, id int64) error {
		_, err := b.sched.CancelTx(ctx, tx, id)
		return err
	})
}

// TestSettleTxRefundOfRiverCancelledJobRetriedPaysAgain: a job River cancelled before it started
// (River's own JobCancel, River UI's Cancel) is refunded with SettleTx and 0 used, as the stranded
// check's fix says; like CancelTx's refund, that removes the job's payment for its first attempt.
// Before, the payment stayed, so the job brought back with River's JobRetry ran through the Gate
// over its kind as paid for by the refunded reservation, and the limit over-granted the whole job.
func TestSettleTxRefundOfRiverCancelledJobRetriedPaysAgain(t *testing.T) {
	t.Parallel()
	refundedJobRetriedPaysAgain(t, func(ctx context.Context, b *testBundle, tx pgx.Tx, id int64) error {
		if _, err := b.client.JobCancelTx(ctx, tx, id); err != nil { // River's own cancel: no refund
			return err
		}
		_, err := b.sched.SettleTx(ctx, tx, id, 0)
		return err
	})
}

// refundedJobRetriedPaysAgain reserves 3 of "calls" (10 per second) with a job behind a Gate over
// its kind, refunds it with refund, brings it back with River's JobRetry and checks that the Gate
// took a token of its run.
func refundedJobRetriedPaysAgain(t *testing.T, refund func(context.Context, *testBundle, pgx.Tx, int64) error) {
	t.Helper()
	ctx := context.Background()
	b := setupCalls(t, tenPerSecond)
	gate := callsGate(t, b, nil)
	var ran atomic.Int32
	w := testdb.RiverWorker(t, nil, &river.Config{Middleware: []rivertype.Middleware{gate}},
		river.WorkFunc(func(context.Context, *river.Job[callArgs]) error { ran.Add(1); return nil }))
	res := reserve(t, b, "calls", "", 3)
	require.Equal(t, 7.0, value(t, b, "calls", ""))
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error { return refund(ctx, b, tx, res.Job.ID) }))
	require.Equal(t, 10.0, value(t, b, "calls", ""), "refunded")
	require.Nil(t, metadataValue(t, jobRow(t, b, res.Job.ID).Metadata, scheduler.MetadataKey), "no payment left after the refund")

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	row, err := b.client.JobRetryTx(ctx, tx, res.Job.ID)
	require.NoError(t, err)
	wr, err := w.WorkJob(ctx, t, tx, row)
	require.NoError(t, err)
	st, err := b.limiter.State(ctx, tx, "calls", "", nil)
	require.NoError(t, err)
	require.False(t, wr.EventKind == river.EventKindJobCompleted && st.Value == 10,
		"the refunded job ran through the Gate (%s) and the limit is still full (%g): its first attempt still counts as paid", wr.EventKind, st.Value)
	require.Equal(t, river.EventKindJobCompleted, wr.EventKind)
	require.Equal(t, 9.0, st.Value, "the Gate took its token")
	require.Equal(t, int32(1), ran.Load())
}

// An actual that differs from the reservation by float rounding (0.1 + 0.2 for a reservation of
// 0.3), or by less than ratelimit's smallest count (10^-9), is a valid actual ("finite and >= 0"):
// it settles as an exact cost, writing nothing. It failed with "LimitN: count must be at least
// 1e-09", an argument the caller never passed, and SettleTx then left the job unsettled. An actual
// above 10^15, the most tokens any call counts, is refused naming actual, not a count of LimitN.
func TestSettleTinyAndHugeDifferences(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := ratelimit.Config{Rate: 10, Period: time.Second, MaxReserved: 1000}
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": cfg}, now: frozen(t0)})
	tenth, fifth := 0.1, 0.2 // float64 arithmetic: 0.30000000000000004

	for _, c := range []struct{ reserved, actual float64 }{
		{0.3, tenth + fifth}, // an overrun of 5.6e-17
		{tenth + fifth, 0.3}, // a credit of 5.6e-17
		{1, 1 - 1e-12},       // a credit below 1e-9
		{1, 1 + 1e-10},       // an overrun below 1e-9
	} {
		before := value(t, b, "calls", "k")
		got, err := scheduler.Settlement{Name: "calls", Key: "k", Reserved: c.reserved}.Settle(ctx, b.pool, b.limiter, c.actual, nil)
		require.NoError(t, err, "Settle: reserved %v, actual %v", c.reserved, c.actual)
		require.Zero(t, got.Charged+got.Credited, "reserved %v, actual %v", c.reserved, c.actual)
		require.Equal(t, before, value(t, b, "calls", "k"))
	}

	res := reserve(t, b, "calls", "u", 0.3)
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		out, err := b.sched.SettleTx(ctx, tx, res.Job.ID, tenth+fifth)
		if err != nil {
			return err
		}
		require.Equal(t, 0.0, out.Limits[0].Charged)
		return nil
	}), "SettleTx: reserved 0.3, actual 0.1 + 0.2")

	for _, actual := range []float64{2e15, 1e300} {
		_, err := scheduler.Settlement{Name: "calls", Key: "k", Reserved: 1}.Settle(ctx, b.pool, b.limiter, actual, nil)
		var arg *ratelimit.ArgumentError
		require.True(t, errors.As(err, &arg), "%v", err)
		require.Equal(t, "actual", arg.Arg, "%v", err)
		res := reserve(t, b, "calls", "v", 1)
		require.NoError(t, inTx(t, b.pool, true, func(tx pgx.Tx) error {
			_, err := b.sched.SettleTx(ctx, tx, res.Job.ID, actual)
			require.True(t, errors.As(err, &arg), "%v", err)
			require.Equal(t, "actual[0]", arg.Arg, "%v", err)
			return nil
		}))
	}
}

// TestPullForwardConcurrent reserves and cancels from 8 goroutines at once, on a frozen clock,
// several cancels racing on one job, with jobs of one limit, then with jobs of two (ReserveManyTx):
// each job is refunded at most once, the limits hold exactly what the jobs not cancelled reserved,
// and every waiting job is due exactly when the reservations up to and including its own, less
// those cancelled, have accrued: the pull-forward of each cancel reached every job reserved after
// the cancelled one, however they interleaved. (Every job here reserves the same limits, so the
// credits of two cancels are made one after the other and no pull-forward finds a job locked by
// another: docs/scheduler.md, "What does not move".)
func TestPullForwardConcurrent(t *testing.T) {
	t.Parallel()
	for _, two := range []bool{false, true} {
		t.Run(fmt.Sprint("two limits ", two), func(t *testing.T) {
			t.Parallel()
			pullForwardConcurrent(t, two)
		})
	}
}

func pullForwardConcurrent(t *testing.T, two bool) {
	ctx := context.Background()
	names := []string{"calls"}
	if two {
		names = append(names, "tokens")
	}
	cfgs := map[string]ratelimit.Config{}
	for _, n := range names {
		cfgs[n] = tenPerSecond
	}
	b := setup(t, &setupOpts{limits: cfgs, now: frozen(t0), maxConns: 16})
	type job struct {
		counts []float64 // one per name
		atOnce bool
	}
	var (
		mu   sync.Mutex
		info = map[int64]job{}
	)
	reserveJob := func(tx pgx.Tx, counts []float64) (int64, error) {
		reqs := make([]ratelimit.Request, len(names))
		for i, n := range names {
			reqs[i] = ratelimit.Request{Name: n, Key: "u1", Count: counts[i]}
		}
		res, err := b.sched.ReserveManyTx(ctx, tx, reqs, callArgs{}, nil)
		if err != nil {
			return 0, err
		}
		mu.Lock()
		info[res.Job.ID] = job{counts: counts, atOnce: res.RetryAt.IsZero()}
		mu.Unlock()
		return res.Job.ID, nil
	}
	var first int64
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) (err error) {
		first, err = reserveJob(tx, slices.Repeat([]float64{10}, len(names))) // empties the buckets
		return err
	}))
	ids, refused := raceReserveAndCancel(t, b.pool, b.sched, first, 8, 16, func(tx pgx.Tx, rng *rand.Rand) (int64, error) {
		counts := make([]float64, len(names))
		for i := range counts {
			counts[i] = float64(1 + rng.IntN(3))
		}
		return reserveJob(tx, counts)
	})

	owed := make([]float64, len(names)) // per limit, the reservations not cancelled up to and including the job's
	for _, id := range ids {
		j, row := info[id], jobRow(t, b, id)
		if row.State == rivertype.JobStateCancelled {
			var s scheduler.JobSettlement
			require.NoError(t, jsonUnmarshal(metadataValue(t, row.Metadata, "txlimit_settled"), &s))
			for i, n := range names {
				require.Equal(t, scheduler.SettledLimit{Name: n, Key: "u1", Reserved: j.counts[i], Credited: j.counts[i]}, s.Limits[i], "job %d", id)
			}
			continue
		}
		want := t0
		for i := range names {
			owed[i] += j.counts[i]
			if at := t0.Add(time.Duration((owed[i] - 10) * float64(100*time.Millisecond))); at.After(want) {
				want = at
			}
		}
		if j.atOnce {
			require.Equal(t, t0, want, "job %d ran at once", id)
			continue
		}
		require.Equal(t, want, row.ScheduledAt.UTC(), "job %d (counts %v, owed %v)", id, j.counts, owed)
	}
	for i, n := range names {
		require.Equal(t, 10-owed[i], value(t, b, n, "u1"), n)
	}
	require.Positive(t, refused, "no cancel met a job cancelled already")
	t.Logf("%d jobs, %v tokens owed, %d cancels refused", len(ids), owed, refused)
}

// TestSettleAndCancelRaceRiversFetch reserves jobs that River works at once (their times, on the
// limiter's frozen clock, lie in the past) and cancels them from 6 goroutines while River fetches
// them; each worker settles its job, using half of it, and completes it in one transaction. Every
// job either ran once and was settled once, or was cancelled with its refund and never ran, and
// the limit holds exactly what the jobs used.
func TestSettleAndCancelRaceRiversFetch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": tenPerSecond}, now: frozen(t0), maxConns: 16})
	var (
		sched *scheduler.Scheduler
		ran   sync.Map // job ID -> *atomic.Int32, the times the worker ran it
	)
	worker := newClient(t, b.pool, &clientOpts{
		queues: map[string]river.QueueConfig{river.QueueDefault: scheduler.PreciseQueue(4)},
		work: func(ctx context.Context, job *river.Job[callArgs]) error {
			n, _ := ran.LoadOrStore(job.ID, new(atomic.Int32))
			n.(*atomic.Int32).Add(1)
			return pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
				if _, err := sched.SettleTx(ctx, tx, job.ID, math.Floor(float64(job.Args.N)/2)); err != nil {
					return err
				}
				_, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job)
				return err
			})
		},
	})
	var err error
	sched, err = scheduler.New(worker, b.limiter, nil)
	require.NoError(t, err)
	first := reserve(t, b, "calls", "u1", 10) // empties the bucket: every later job waits, on the frozen clock
	startClient(t, worker)

	var mu sync.Mutex
	count := map[int64]int{first.Job.ID: 10} // reserved; the job uses half its args' N, the first 0
	ids, _ := raceReserveAndCancel(t, b.pool, sched, first.Job.ID, 6, 20, func(tx pgx.Tx, rng *rand.Rand) (int64, error) {
		n := 2 + rng.IntN(3)
		res, err := sched.ReserveTx(ctx, tx, "calls", "u1", float64(n), callArgs{N: n}, nil)
		if err != nil {
			return 0, err
		}
		mu.Lock()
		count[res.Job.ID] = n
		mu.Unlock()
		return res.Job.ID, nil
	})

	used, cancelled := 0.0, 0
	for _, id := range ids {
		var row *rivertype.JobRow
		require.Eventually(t, func() bool {
			row = jobRow(t, b, id)
			return row.State == rivertype.JobStateCompleted || row.State == rivertype.JobStateCancelled
		}, 60*time.Second, 10*time.Millisecond, "job %d", id)
		var s scheduler.JobSettlement
		require.NoError(t, jsonUnmarshal(metadataValue(t, row.Metadata, "txlimit_settled"), &s), "job %d", id)
		n, _ := ran.Load(id)
		reserved, actual := float64(count[id]), math.Floor(float64(count[id])/2)
		if id == first.Job.ID {
			actual = 0 // its args' N is 0
		}
		if row.State == rivertype.JobStateCancelled {
			require.Nil(t, n, "job %d ran and was cancelled", id)
			require.True(t, s.Cancelled)
			require.Equal(t, reserved, s.Limits[0].Credited)
			cancelled++
			continue
		}
		require.NotNil(t, n, "job %d", id)
		require.Equal(t, int32(1), n.(*atomic.Int32).Load(), "job %d", id)
		require.False(t, s.Cancelled)
		require.Equal(t, reserved-actual, s.Limits[0].Credited, "job %d", id)
		used += actual
	}
	require.Equal(t, 10-used, value(t, b, "calls", "u1"))
	require.Positive(t, cancelled, "no job was cancelled: the test tests nothing")
	t.Logf("%d jobs, %d cancelled", len(ids), cancelled)
}

// TestSettleTxRacesCancelTxSerializable settles (1 of 4 used) and cancels each of five waiting
// jobs from 12 goroutines at once, each call in InSerializableTx (serialization failures
// retried): each job is settled by exactly one of them, the others answering with its outcome
// (SettleTx: Repeated) or refused (CancelTx: Settled), and the limit is credited exactly what the
// winners gave back.
func TestSettleTxRacesCancelTxSerializable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": tenPerSecond}, now: frozen(t0), maxConns: 16})
	reserve(t, b, "calls", "u1", 10)
	ids := make([]int64, 5)
	for i := range ids {
		ids[i] = reserve(t, b, "calls", "u1", 4).Job.ID
	}
	var (
		won   [5]atomic.Int32
		wg    sync.WaitGroup
		start = make(chan struct{})
	)
	for g := range 12 {
		wg.Go(func() {
			<-start
			var first bool // in the attempt that committed
			err := ratelimit.InSerializableTx(ctx, b.pool, &ratelimit.TxOpts{MaxAttempts: 100}, func(ctx context.Context, tx pgx.Tx) error {
				var out *scheduler.JobSettlement
				var err error
				if g%2 == 0 {
					out, err = b.sched.SettleTx(ctx, tx, ids[g%5], 1)
				} else {
					out, err = b.sched.CancelTx(ctx, tx, ids[g%5])
				}
				var nc *scheduler.NotCancellableError
				first = err == nil && !out.Repeated
				if errors.As(err, &nc) && nc.Settled {
					return nil
				}
				return err
			})
			if err != nil {
				t.Error(err)
			}
			if first {
				won[g%5].Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	require.False(t, t.Failed())
	credited := 0.0
	for i, id := range ids {
		require.Equal(t, int32(1), won[i].Load(), "job %d settled by %d calls", id, won[i].Load())
		var s scheduler.JobSettlement
		require.NoError(t, jsonUnmarshal(metadataValue(t, jobRow(t, b, id).Metadata, "txlimit_settled"), &s))
		want := 3.0 // settled: 1 of 4 used
		if s.Cancelled {
			want = 4
		}
		require.Equal(t, want, s.Limits[0].Credited, "job %d", id)
		credited += want
	}
	require.Equal(t, -20+credited, value(t, b, "calls", "u1"))
}

// raceReserveAndCancel runs workers goroutines at once, each making rounds transactions on pool
// that either reserve a job with reserveJob or cancel (sched.CancelTx) a job picked at random
// among first and those reserved and committed so far. A refusal (a job cancelled already, or
// started) is no error. It returns every job's ID, in ID order, and how many cancels were refused.
func raceReserveAndCancel(t *testing.T, pool *pgxpool.Pool, sched *scheduler.Scheduler, first int64, workers, rounds int,
	reserveJob func(tx pgx.Tx, rng *rand.Rand) (int64, error)) ([]int64, int32) {
	t.Helper()
	ctx := context.Background()
	var (
		mu      sync.Mutex
		ids     = []int64{first}
		refused atomic.Int32
		wg      sync.WaitGroup
		start   = make(chan struct{})
	)
	for w := range workers {
		wg.Go(func() {
			<-start
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for range rounds {
				mu.Lock()
				target := ids[rng.IntN(len(ids))]
				mu.Unlock()
				var added int64
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if rng.IntN(2) == 0 {
						var err error
						added, err = reserveJob(tx, rng)
						return err
					}
					_, err := sched.CancelTx(ctx, tx, target)
					if errors.Is(err, scheduler.ErrNotCancellable) {
						refused.Add(1)
						return nil
					}
					return err
				})
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				if added != 0 { // committed: the others may cancel it now
					mu.Lock()
					ids = append(ids, added)
					mu.Unlock()
				}
			}
		})
	}
	close(start)
	wg.Wait()
	require.False(t, t.Failed())
	slices.Sort(ids)
	return ids, refused.Load()
}
