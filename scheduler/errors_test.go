package scheduler_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// TestArgumentErrorsNameTheCall: bad input to a call of this package is an
// *ratelimit.ArgumentError (ratelimit.ErrInvalid) whose message names the call the user made,
// "scheduler: New: ...", not "ratelimit: scheduler.New: ..." (issue 31, item 6).
func TestArgumentErrorsNameTheCall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lim, err := ratelimit.New(nil)
	require.NoError(t, err)
	sched := &scheduler.Scheduler{} // the calls below fail on their arguments first
	for i, c := range []struct {
		err  error
		want string
	}{
		{err: second(scheduler.New(nil, lim, nil)), want: "scheduler: New: client is nil: pass the *river.Client that inserts the jobs"},
		{err: second(sched.ReserveTx(ctx, nil, "calls", "k", 1, callArgs{}, nil)), want: "scheduler: ReserveTx: tx is nil: pass the pgx.Tx the job and the reservation belong to"},
		{err: second(sched.CancelTx(ctx, nil, 1)), want: "scheduler: CancelTx: tx is nil: pass the pgx.Tx to cancel in"},
		{err: second(sched.SettleTx(ctx, nil, 1, 1)), want: "scheduler: SettleTx: tx is nil: pass the pgx.Tx to settle in"},
		{err: sched.Check(ctx, nil, nil), want: "scheduler: Check: db is nil: pass the *pgxpool.Pool of the River client"},
		{err: second(scheduler.NewGate(nil)), want: "scheduler: NewGate: config is nil: set DB, Limit and Limiter"},
		{err: second(scheduler.Housekeeping(river.NewWorkers(), lim, nil, nil)), want: "scheduler: Housekeeping: db is nil: pass the *pgxpool.Pool of the River client"},
		{err: scheduler.Migrate(ctx, nil, nil), want: "scheduler: Migrate: pool is nil: pass the *pgxpool.Pool to migrate"},
		{err: second(scheduler.Settlement{Name: "calls"}.Settle(ctx, nil, nil, 1, nil)), want: "scheduler: Settle: limiter is nil: pass the *ratelimit.Limiter the tokens were reserved with"},
	} {
		require.EqualError(t, c.err, c.want, "case %d", i)
		var ae *ratelimit.ArgumentError
		require.ErrorAs(t, c.err, &ae, "case %d", i)
		require.ErrorIs(t, c.err, ratelimit.ErrInvalid, "case %d", i)
	}
}

// TestOneSetupError: package ratelimit and package scheduler report set-up mistakes with one type,
// whose Package says who found it; one ErrSetup matches both, each Problem only its own, and each
// message leads with the fix and names the call.
func TestOneSetupError(t *testing.T) {
	t.Parallel()
	schema := error(&ratelimit.SetupError{Package: "ratelimit", Op: "Limit", Fix: "migrations.Up", SearchPath: "app",
		Err: &pgconn.PgError{Code: "42883", Message: "function txlimit_decide(integer[]) does not exist"}})
	hook := error(&scheduler.SetupError{Package: "scheduler", Op: "ReserveTx", Problem: scheduler.ErrNoPreciseHook, Fix: "add the hook"})

	for i, c := range []struct {
		err     error
		pkg     string
		problem error
		msg     string
	}{
		{schema, "ratelimit", nil, `ratelimit: Limit: run migrations.Up(ctx, pool) at start-up with this search_path (adding migrations.CreateSchema() if its schema does not exist yet), or set search_path to the schema it ran in: function txlimit_decide does not exist in search_path "app" (SQLSTATE 42883; see docs/deploy.md)`},
		{hook, "scheduler", scheduler.ErrNoPreciseHook, `scheduler: ReserveTx: add the hook (PreciseHook is not registered on the River client)`},
	} {
		var se *scheduler.SetupError // the same type as *ratelimit.SetupError
		require.True(t, errors.As(c.err, &se), "step %d", i)
		require.Equal(t, c.pkg, se.Package, "step %d", i)
		require.ErrorIs(t, c.err, ratelimit.ErrSetup, "step %d", i)
		require.ErrorIs(t, c.err, scheduler.ErrSetup, "step %d", i)
		require.NotErrorIs(t, c.err, ratelimit.ErrInvalid, "step %d", i)
		require.Equal(t, c.problem != nil, errors.Is(c.err, scheduler.ErrNoPreciseHook), "step %d", i)
		require.NotErrorIs(t, c.err, scheduler.ErrNoRiverTables, "step %d", i)
		require.EqualError(t, c.err, c.msg, "step %d", i)
	}
}

// recovered runs f and returns what it panicked with, if it did.
func recovered(f func()) (v any) {
	defer func() { v = recover() }()
	f()
	return nil
}

// TestTypedNilIsBadInput: a nil pointer in an interface (a nil *pgxpool.Tx as a pgx.Tx, a nil
// *pgxpool.Pool as a db, a nil *callArgs as args) is bad input like an untyped nil, as in package
// ratelimit (docs/spec.md §5: "a nil Executor, a typed nil pointer included"): an *ratelimit.ArgumentError
// naming its type, returned before anything is written. Before, each panicked; the args one in
// River's insert, after LimitN had reserved the tokens in tx, with the savepoint left open, so a
// caller that recovered and committed kept a reservation with no job.
func TestTypedNilIsBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setupCalls(t, perMinute10)
	var nilTx *pgxpool.Tx
	var nilPool *pgxpool.Pool
	for _, c := range []struct {
		what string
		call func() error
	}{
		{"ReserveTx with a nil *pgxpool.Tx", func() error {
			_, err := b.sched.ReserveTx(ctx, nilTx, "calls", "u1", 1, callArgs{}, nil)
			return err
		}},
		{"CancelTx with a nil *pgxpool.Tx", func() error { _, err := b.sched.CancelTx(ctx, nilTx, 1); return err }},
		{"SettleTx with a nil *pgxpool.Tx", func() error { _, err := b.sched.SettleTx(ctx, nilTx, 1, 1); return err }},
		{"Check with a nil *pgxpool.Pool", func() error { return b.sched.Check(ctx, nilPool, callArgs{}) }},
		{"Check with a nil *callArgs probe", func() error { return b.sched.Check(ctx, b.pool, (*callArgs)(nil)) }},
		{"ReserveManyTx with a nil *pgxpool.Tx", func() error {
			_, err := b.sched.ReserveManyTx(ctx, nilTx, []ratelimit.Request{{Name: "calls", Key: "u1"}}, callArgs{}, nil)
			return err
		}},
		{"Settle with a nil *pgxpool.Pool", func() error {
			_, err := scheduler.Settlement{Name: "calls", Key: "u1", Reserved: 1}.Settle(ctx, nilPool, b.limiter, 0, nil)
			return err
		}},
		{"NewGate with a nil *pgxpool.Pool", func() error {
			_, err := scheduler.NewGate(&scheduler.GateConfig{DB: nilPool, Limiter: b.limiter, Limit: gateCalls})
			return err
		}},
		{"Housekeeping with a nil *pgxpool.Pool", func() error {
			_, err := scheduler.Housekeeping(river.NewWorkers(), b.limiter, nilPool, nil)
			return err
		}},
	} {
		var err error
		if p := recovered(func() { err = c.call() }); p != nil {
			t.Errorf("%s panicked: %v", c.what, p)
			continue
		}
		if !errors.Is(err, ratelimit.ErrInvalid) {
			t.Errorf("%s: %v, want an error matching ratelimit.ErrInvalid", c.what, err)
		}
	}
	_, err := b.sched.ReserveTx(ctx, nilTx, "calls", "u1", 1, callArgs{}, nil)
	require.EqualError(t, err, "scheduler: ReserveTx: tx is a nil *pgxpool.Tx: pass the pgx.Tx the job and the reservation belong to")

	require.NoError(t, inTx(t, b.pool, false, func(tx pgx.Tx) error {
		var err error
		p := recovered(func() { _, err = b.sched.ReserveTx(ctx, tx, "calls", "u1", 1, (*callArgs)(nil), nil) })
		require.Nil(t, p, "ReserveTx with a nil *callArgs panicked (the tokens reserved in tx: %g left)", valueIn(t, b, tx))
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
		p = recovered(func() {
			_, err = b.sched.ReserveManyTx(ctx, tx, []ratelimit.Request{{Name: "calls", Key: "u1"}}, (*callArgs)(nil), nil)
		})
		require.Nil(t, p, "ReserveManyTx with a nil *callArgs panicked")
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
		return nil
	}))
	require.Equal(t, 10.0, value(t, b, "calls", "u1"), "nothing reserved")
	require.Empty(t, jobs(t, b.client), "no job")
}

// valueIn is the value of calls/u1 as tx sees it.
func valueIn(t *testing.T, b *testBundle, tx pgx.Tx) float64 {
	t.Helper()
	st, err := b.limiter.State(context.Background(), tx, "calls", "u1", nil)
	require.NoError(t, err)
	return st.Value
}
