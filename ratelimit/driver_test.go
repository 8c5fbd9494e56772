package ratelimit_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/driver/drivertest"
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
	for _, m := range []struct {
		name string
		mode pgx.QueryExecMode
	}{{"default", 0}, {"exec", pgx.QueryExecModeExec}, {"simple_protocol", pgx.QueryExecModeSimpleProtocol},
		{"cache_describe", pgx.QueryExecModeCacheDescribe}} {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			drivertest.Run(t, pgxHandle(m.mode))
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
