package scheduler_test

import (
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

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
		{schema, "ratelimit", nil, `ratelimit: Limit: run migrations.Up(ctx, pool) at start-up with this search_path, or set search_path to the schema it ran in: function txlimit_decide does not exist in search_path "app" (SQLSTATE 42883; see docs/deploy.md)`},
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
