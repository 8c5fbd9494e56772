package scheduler_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/pgbouncertest"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/scheduler"
)

// conn is how a test reaches Postgres: directly or through PgBouncer (make test-pgbouncer), with
// one pgx exec mode. The zero conn is what most tests use: directly, in pgx's default mode.
type conn struct {
	mode    pgx.QueryExecMode // 0: pgx's default (cache_statement)
	bouncer bool
}

// pool returns a pool of at most maxConns connections on a schema of the test's own with txlimit's
// migrations applied (and River's, unless noRiver), dropped when the test ends.
func (c conn) pool(t testing.TB, maxConns int32, noRiver bool) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	var pool *pgxpool.Pool
	switch {
	case c.bouncer:
		pool = pgbouncertest.New(t).Pool(t, c.mode, maxConns)
		require.NoError(t, migrations.Up(ctx, pool))
	case c.mode == 0:
		pool = testdb.Pool(t, &testdb.Options{MaxConns: maxConns})
	default:
		cfg, err := pgxpool.ParseConfig(testdb.DSN(t))
		require.NoError(t, err)
		cfg.ConnConfig.RuntimeParams["search_path"] = testdb.NewSchema(t)
		cfg.ConnConfig.DefaultQueryExecMode = c.mode
		cfg.MaxConns = maxConns
		pool, err = pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		require.NoError(t, migrations.Up(ctx, pool))
	}
	if !noRiver {
		require.NoError(t, scheduler.Migrate(ctx, pool, nil))
	}
	return pool
}

// direct runs scenario, in parallel, directly on Postgres in pgx's default mode: the Test
// function of each scenario TestExecModes also runs in the other modes and through PgBouncer.
func direct(t *testing.T, scenario func(t *testing.T, c conn)) {
	t.Parallel()
	scenario(t, conn{})
}

// TestExecModes runs the scheduler's statements (River's insert, the queue check, Check, CancelTx,
// SettleTx, the pull-forward's Waiting and Reschedule, the stranded-job check) in every pgx exec
// mode docs/deploy.md calls safe behind a transaction-mode pooler (pgbouncertest.SafeModes),
// directly on Postgres and through PgBouncer. The subtests are the same functions the other
// tests run in pgx's default mode. The PgBouncer ones are skipped unless TXLIMIT_PGBOUNCER_URL is
// set: make test-pgbouncer runs them (-run '^TestExecModes$/^pgbouncer$').
func TestExecModes(t *testing.T) {
	t.Parallel()
	scenarios := []struct {
		name string
		run  func(t *testing.T, c conn)
	}{
		{"ReserveTx", reserveTx},
		{"CancelTx", cancelTx},
		{"CancelTxManyLimits", cancelTxManyLimits},
		{"SettleTxOnce", settleTxOnce},
		{"PullForwardModel", func(t *testing.T, c conn) { pullForwardModel(t, c, 1) }},
		{"Check", check},
		{"MissingRiverTables", missingRiverTables},
		{"UnworkedQueue", unworkedQueue},
		{"Stranded", stranded},
	}
	for _, via := range []struct {
		name    string
		bouncer bool
	}{{"direct", false}, {"pgbouncer", true}} {
		t.Run(via.name, func(t *testing.T) {
			t.Parallel()
			for _, m := range pgbouncertest.SafeModes {
				t.Run(m.Name, func(t *testing.T) {
					c := conn{mode: m.Mode, bouncer: via.bouncer}
					for _, s := range scenarios {
						t.Run(s.name, func(t *testing.T) { s.run(t, c) })
					}
				})
			}
		})
	}
}
