package scheduler_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// docs/scheduler.md (ReserveTx's outcomes): a job whose insert options are invalid is bad input,
// an *ratelimit.ArgumentError (ratelimit.ErrInvalid), with nothing reserved and no job, whether
// River or Postgres refuses them. A ScheduledAt before the year 0 (which the job's JSON metadata
// cannot hold) failed with an untyped JSON error, a negative MaxAttempts with Postgres's check
// violation (SQLSTATE 23514) and metadata holding invalid UTF-8 with SQLSTATE 22021, all untyped.
func TestReserveTxInsertOptionsRefused(t *testing.T) {
	t.Parallel()
	b := setupCalls(t, ratelimit.Config{Rate: 1, Period: time.Hour, MaxReserved: 10})
	ctx := context.Background()
	for _, c := range []struct {
		what string
		opts river.InsertOpts
		arg  string
	}{
		{"ScheduledAt before the year 0", river.InsertOpts{ScheduledAt: time.Date(-1, 6, 1, 0, 0, 0, 0, time.UTC)}, "ReserveOpts.InsertOpts.ScheduledAt"},
		{"MaxAttempts negative", river.InsertOpts{MaxAttempts: -1}, "args or insert options"},
		{"Metadata not UTF-8", river.InsertOpts{Metadata: []byte(`{"note": "` + "\xff" + `"}`)}, "args or insert options"},
	} {
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			_, err := b.sched.ReserveTx(ctx, tx, "calls", "k", 1, callArgs{}, &scheduler.ReserveOpts{InsertOpts: &c.opts})
			var ae *ratelimit.ArgumentError
			require.ErrorAs(t, err, &ae, "%s: %v", c.what, err)
			require.ErrorIs(t, err, ratelimit.ErrInvalid, c.what)
			require.Equal(t, c.arg, ae.Arg, "%s: %v", c.what, err)
			st, err := b.limiter.State(ctx, tx, "calls", "k", nil)
			require.NoError(t, err, "%s: tx still usable", c.what)
			require.Equal(t, 1.0, st.Value, "%s: nothing reserved", c.what)
			return nil
		}))
	}
	var jobs int
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT count(*) FROM river_job").Scan(&jobs))
	require.Zero(t, jobs)
}
