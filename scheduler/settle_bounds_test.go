package scheduler_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

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
