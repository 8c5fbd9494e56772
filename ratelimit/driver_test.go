package ratelimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/driver/drivertest"
	"github.com/txlimit/txlimit/internal/pgbouncertest"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// pgxHandle opens the contract's handle on pgx in mode (0: pgx's default): calls on a
// *pgxpool.Pool, and a caller's pgx.Tx.
func pgxHandle(mode pgx.QueryExecMode) drivertest.Open {
	return func(t *testing.T, migrate bool) drivertest.Handle {
		t.Helper()
		ctx := context.Background()
		pool := testdb.Pool(t, &testdb.Options{MaxConns: 4, NoMigrate: !migrate, QueryExecMode: mode})
		return drivertest.Handle{
			DB: pool, Inspect: pool,
			Begin: func(t *testing.T, serializable bool) (ratelimit.Executor, func() error, func() error) {
				opts := pgx.TxOptions{}
				if serializable {
					opts.IsoLevel = pgx.Serializable
				}
				tx, err := pool.BeginTx(ctx, opts)
				require.NoError(t, err)
				t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
				return tx, func() error { return tx.Commit(ctx) }, func() error { return tx.Rollback(ctx) }
			},
		}
	}
}

// TestDriverContractPgx runs the driver contract on pgx: on a *pgxpool.Pool and in a pgx.Tx (the
// suite's Begin), in pgx's default mode and in QueryExecModeExec, QueryExecModeSimpleProtocol and
// QueryExecModeCacheDescribe.
func TestDriverContractPgx(t *testing.T) {
	t.Parallel()
	for _, m := range pgbouncertest.WithDefault() {
		t.Run(m.Name, func(t *testing.T) {
			t.Parallel()
			drivertest.Run(t, pgxHandle(m.Mode))
		})
	}
}

// TestDriverContractPgxConn runs the script on a *pgx.Conn, the third pgx handle.
func TestDriverContractPgxConn(t *testing.T) {
	t.Parallel()
	h := pgxHandle(0)(t, true)
	conn, err := h.Inspect.Acquire(context.Background())
	require.NoError(t, err)
	defer conn.Release()
	drivertest.Script(t, conn.Conn())
}

// TestTextResultsNeedDefaultSettings pins what docs/deploy.md says of the exec and
// simple-protocol modes: pgx reads every result as text there, as the session's settings write it.
// With bytea_output = escape a decision's answer (a bytea) cannot be read: the call is an error,
// its statement having run (on a pool, committed: State shows the charge). With
// extra_float_digits = 0 State's value is read rounded to 15 significant digits. pgx's default
// mode and cache_describe read results in binary and are not affected.
func TestTextResultsNeedDefaultSettings(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	limits := map[string]ratelimit.Config{"third": {Rate: 1, Period: 3 * time.Second, Capacity: 10}}
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, m := range pgbouncertest.WithDefault() {
		text := m.Mode == pgx.QueryExecModeExec || m.Mode == pgx.QueryExecModeSimpleProtocol
		t.Run(m.Name, func(t *testing.T) {
			t.Parallel()
			lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: limits, Now: func() time.Time { return at }})
			require.NoError(t, err)
			escape := testdb.Pool(t, &testdb.Options{QueryExecMode: m.Mode, RuntimeParams: map[string]string{"bytea_output": "escape"}})
			r, err := lim.LimitN(ctx, escape, "third", "k", 4, nil)
			st, serr := lim.State(ctx, escape, "third", "k", nil)
			require.NoError(t, serr)
			require.Equal(t, 6.0, st.Value, "charged, whether or not the answer could be read")
			if text {
				require.ErrorContains(t, err, "invalid hex format")
				require.False(t, r.OK)
			} else {
				require.NoError(t, err)
				require.True(t, r.OK)
			}

			// 10 − 10 + 1/3 token a second later: 0.3333333333333333 as float8.
			rounding := testdb.Pool(t, &testdb.Options{QueryExecMode: m.Mode, RuntimeParams: map[string]string{"extra_float_digits": "0"}})
			_, err = lim.LimitN(ctx, rounding, "third", "k", 10, nil)
			require.NoError(t, err)
			later, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: limits, Now: func() time.Time { return at.Add(time.Second) }})
			require.NoError(t, err)
			st, err = later.State(ctx, rounding, "third", "k", nil)
			require.NoError(t, err)
			if text {
				require.Equal(t, 0.333333333333333, st.Value)
			} else {
				require.Equal(t, 1.0/3, st.Value)
			}
		})
	}
}
