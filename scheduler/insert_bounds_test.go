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

// The years 0 to 9999 that ReserveTx takes in InsertOpts.ScheduledAt are those of the instant in
// UTC, in which the job's metadata records it (NotBefore): a ScheduledAt of 9999-12-31 23:00 at
// UTC-5 (10000-01-01 in UTC) or of 0000-01-01 01:00 at UTC+5 (the year -1 in UTC) passed the check,
// which read the year in the time's own zone, and then failed untyped when the reservation was
// recorded ("record the reservation: json: ... year outside of range [0,9999]").
func TestReserveTxScheduledAtYearInUTC(t *testing.T) {
	t.Parallel()
	b := setupCalls(t, ratelimit.Config{Rate: 1, Period: time.Hour, MaxReserved: 10})
	ctx := context.Background()
	for _, at := range []time.Time{
		time.Date(9999, 12, 31, 23, 0, 0, 0, time.FixedZone("UTC-5", -5*3600)),
		time.Date(0, 1, 1, 1, 0, 0, 0, time.FixedZone("UTC+5", 5*3600)),
	} {
		require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
			_, err := b.sched.ReserveTx(ctx, tx, "calls", "k", 1, callArgs{}, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{ScheduledAt: at}})
			var ae *ratelimit.ArgumentError
			require.ErrorAs(t, err, &ae, "%s: %v", at, err)
			require.Equal(t, "ReserveOpts.InsertOpts.ScheduledAt", ae.Arg, "%s: %v", at, err)
			st, err := b.limiter.State(ctx, tx, "calls", "k", nil)
			require.NoError(t, err)
			require.Equal(t, 1.0, st.Value, "%s: nothing reserved", at)
			return nil
		}))
	}
	// And the other way round: an instant within the years 0 to 9999 in UTC is taken, whatever
	// its own zone says (here 10000-01-01 03:00 at UTC+5, which is 9999-12-31 22:00 in UTC; it was
	// refused as "count reserves tokens due only at 10000-01-01T03:00:00+05:00").
	at := time.Date(10000, 1, 1, 3, 0, 0, 0, time.FixedZone("UTC+5", 5*3600))
	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		r, err := b.sched.ReserveTx(ctx, tx, "calls", "k", 1, callArgs{}, &scheduler.ReserveOpts{InsertOpts: &river.InsertOpts{ScheduledAt: at}})
		require.NoError(t, err, "%s", at)
		require.True(t, r.Job.ScheduledAt.Equal(at), "job scheduled at %s", r.Job.ScheduledAt)
		return nil
	}))
}

// Every time ReserveTx records in the job's metadata (JSON) must lie within the years 0 to 9999.
// ratelimit accepts a FixedWindow Config.Start at any instant and a LimiterConfig.Now down to
// -2^61 µs, but a reservation with an inline config whose Start lies outside those years, or made
// on a clock before the year 0, is bad input: an *ratelimit.ArgumentError naming the Start or the
// clock, with nothing reserved and no job. Both failed untyped, with "record the reservation: json:
// error calling MarshalJSON for type time.Time".
func TestReserveTxTimesTheMetadataCannotHold(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, ratelimit.Config{Rate: 1, Period: time.Hour, MaxReserved: 10})
	for _, start := range []time.Time{time.Date(10001, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(-5, 1, 1, 0, 0, 0, 0, time.UTC)} {
		cfg := ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 1, Period: time.Hour, MaxReserved: 10, Start: start}
		for _, c := range []struct {
			arg     string
			reserve func(tx pgx.Tx) error
		}{
			{"ReserveOpts.Config.Start", func(tx pgx.Tx) error {
				_, err := b.sched.ReserveTx(ctx, tx, "inline", "k", 1, callArgs{}, &scheduler.ReserveOpts{Config: &cfg})
				return err
			}},
			{"reqs[1].Config.Start", func(tx pgx.Tx) error {
				_, err := b.sched.ReserveManyTx(ctx, tx, []ratelimit.Request{{Name: "calls", Key: "k"}, {Name: "inline", Key: "k", Config: &cfg}}, callArgs{}, nil)
				return err
			}},
		} {
			require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
				err := c.reserve(tx)
				var ae *ratelimit.ArgumentError
				require.ErrorAs(t, err, &ae, "Start %s: %v", start, err)
				require.Equal(t, c.arg, ae.Arg, "Start %s: %v", start, err)
				return nil
			}))
		}
	}
	past := setup(t, &setupOpts{limits: map[string]ratelimit.Config{"calls": {Rate: 1, Period: time.Hour, MaxReserved: 10}},
		now: frozen(time.Date(-100, 1, 1, 0, 0, 0, 0, time.UTC))})
	require.NoError(t, inTx(t, past.pool, false, func(tx pgx.Tx) error {
		r, err := past.sched.ReserveTx(ctx, tx, "calls", "k", 1, callArgs{}, nil) // the tokens are there: nothing waits
		require.NoError(t, err)
		require.True(t, r.RetryAt.IsZero())
		_, err = past.sched.ReserveTx(ctx, tx, "calls", "k", 1, callArgs{}, nil) // due in the year -100
		var ae *ratelimit.ArgumentError
		require.ErrorAs(t, err, &ae, "%v", err)
		require.Equal(t, "LimiterConfig.Now", ae.Arg, "%v", err)
		return nil
	}))
	for _, b := range []*testBundle{b, past} {
		st, err := b.limiter.State(ctx, b.pool, "calls", "k", nil)
		require.NoError(t, err)
		want := 1.0 // nothing reserved
		if b == past {
			want = 0 // what the one job that runs now took, nothing more
		}
		require.Equal(t, want, st.Value)
		var jobs int
		require.NoError(t, b.pool.QueryRow(ctx, "SELECT count(*) FROM river_job").Scan(&jobs))
		require.Equal(t, b == past, jobs == 1)
	}
}
