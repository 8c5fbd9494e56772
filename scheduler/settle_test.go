package scheduler_test

import (
	"context"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

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
