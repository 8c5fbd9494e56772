package sqldb_test

import (
	"database/sql"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/driver/drivertest"
	"github.com/txlimit/txlimit/internal/pgbouncertest"
	"github.com/txlimit/txlimit/internal/testdb"
)

// TestDriverContractPoolerSafe runs the driver contract, directly on Postgres, in the database/sql
// configurations docs/deploy.md calls safe behind a transaction pooler: the pgx stdlib driver in
// each of pgbouncertest.SafeModes, and lib/pq with binary_parameters=yes (make test-pgbouncer runs
// them through PgBouncer: TestDatabaseSQLThroughPgBouncer).
func TestDriverContractPoolerSafe(t *testing.T) {
	t.Parallel()
	for _, m := range pgbouncertest.SafeModes {
		t.Run("pgx_"+m.Name, func(t *testing.T) {
			t.Parallel()
			drivertest.Run(t, openedHandle(func(t *testing.T, url string) *sql.DB {
				cfg, err := pgx.ParseConfig(url)
				require.NoError(t, err)
				cfg.DefaultQueryExecMode = m.Mode
				return stdlib.OpenDB(*cfg)
			}))
		})
	}
	t.Run("postgres_binary_parameters", func(t *testing.T) {
		t.Parallel()
		drivertest.Run(t, openedHandle(func(t *testing.T, url string) *sql.DB {
			db, err := sql.Open("postgres", url+"&binary_parameters=yes")
			require.NoError(t, err)
			return db
		}))
	})
}

// openedHandle is sqlHandle with open making the *sql.DB from the URL of the handle's schema.
func openedHandle(open func(t *testing.T, url string) *sql.DB) drivertest.Open {
	return func(t *testing.T, migrate bool) drivertest.Handle {
		t.Helper()
		_, pool := testdb.SQLDB(t, "pgx", migrate)
		db := open(t, testdb.SchemaURL(t, pool.Config().ConnConfig.RuntimeParams["search_path"]))
		db.SetMaxOpenConns(4)
		t.Cleanup(func() { _ = db.Close() })
		return handleOf(db, pool)
	}
}
