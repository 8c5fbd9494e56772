package sqldb_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/driver"
	"github.com/txlimit/txlimit/internal/driver/drivertest"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/sqldb"
)

// handleOf is the contract suite's handle of db (Inspect: pool, on the same schema).
func handleOf(db *sql.DB, pool *pgxpool.Pool) drivertest.Handle {
	return drivertest.Handle{
		DB: sqldb.Wrap(db), Inspect: pool,
		Begin: func(t *testing.T, serializable bool) (ratelimit.Executor, func() error, func() error) {
			opts := &sql.TxOptions{}
			if serializable {
				opts.Isolation = sql.LevelSerializable
			}
			tx, err := db.BeginTx(context.Background(), opts)
			require.NoError(t, err)
			t.Cleanup(func() { _ = tx.Rollback() })
			return sqldb.Wrap(tx), tx.Commit, tx.Rollback
		},
	}
}

// sqlHandle opens the contract's handle on database/sql with driver ("pgx": pgx's stdlib,
// "postgres": lib/pq): calls on the *sql.DB, and a caller's *sql.Tx.
func sqlHandle(driver string) drivertest.Open {
	return func(t *testing.T, migrate bool) drivertest.Handle {
		t.Helper()
		db, pool := testdb.SQLDB(t, driver, migrate)
		return handleOf(db, pool)
	}
}

// TestDriverContract runs the driver contract on database/sql with the pgx stdlib driver and with
// lib/pq: on a *sql.DB and in a caller's *sql.Tx that rolls back and commits.
func TestDriverContract(t *testing.T) {
	t.Parallel()
	for _, driver := range testdb.SQLDrivers {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			drivertest.Run(t, sqlHandle(driver))
		})
	}
}

// TestConn runs the script on a *sql.Conn, which makes decisions of its own.
func TestConn(t *testing.T) {
	t.Parallel()
	for _, driver := range testdb.SQLDrivers {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			db, _ := testdb.SQLDB(t, driver, true)
			conn, err := db.Conn(context.Background())
			require.NoError(t, err)
			defer conn.Close()
			drivertest.Script(t, sqldb.Wrap(conn))
		})
	}
}

// embedsDB has the shape of *sqlx.DB: a struct embedding *sql.DB.
type embedsDB struct{ *sql.DB }

// TestPooled: a *sql.DB is a pool whose statements are transactions of their own, so that
// ratelimit admits its lone calls on a sharded key as on a *pgxpool.Pool (docs/spec.md §8,
// Admission); a *sql.Tx and a *sql.Conn are not, nor is a handle embedding a *sql.DB.
func TestPooled(t *testing.T) {
	t.Parallel()
	db, _ := testdb.SQLDB(t, "pgx", false)
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	defer conn.Close()
	for _, c := range []struct {
		h    sqldb.Querier
		want bool
	}{{db, true}, {embedsDB{db}, false}, {tx, false}, {conn, false}} {
		p, ok := sqldb.Wrap(c.h).(driver.Pooled)
		require.True(t, ok, "%T", c.h)
		require.Equal(t, c.want, p.Pool() != nil, "%T", c.h)
	}
	// Two wraps of one *sql.DB are one pool: their calls share a key's slots.
	require.True(t, sqldb.Wrap(db).(driver.Pooled).Pool() == sqldb.Wrap(db).(driver.Pooled).Pool())
}

// taggedDB is a handle embedding *sql.DB beside a field of interface type: its type is comparable,
// but a value holding a slice there is not.
type taggedDB struct {
	*sql.DB
	tag any
}

// Two Wraps of one *sql.DB are one pool (driver.Pooled: equal for every Executor of that pool);
// a handle embedding the *sql.DB is not looked into, so a handle whose value cannot be compared
// (a slice in an interface field) is decided, not a panic in the admission's map.
func TestPooledIdentity(t *testing.T) {
	t.Parallel()
	db, _ := testdb.SQLDB(t, "pgx", true)
	pool := func(h sqldb.Querier) any { return sqldb.Wrap(h).(driver.Pooled).Pool() }
	require.True(t, pool(db) == pool(db), "two Wraps of one *sql.DB are one pool")
	tagged := taggedDB{db, []string{"x"}}
	require.Nil(t, pool(tagged))

	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"s": {Rate: 4, Period: time.Minute, Shards: 2},
	}})
	require.NoError(t, err)
	for _, h := range []sqldb.Querier{tagged, db} {
		res, err := lim.Limit(context.Background(), sqldb.Wrap(h), "s", "k", nil)
		require.NoError(t, err)
		require.True(t, res.OK)
	}
}

// TestWrapNil: a nil handle gives a nil Executor, which every call refuses as bad input; a bare
// *sql.Tx is refused with the fix.
func TestWrapNil(t *testing.T) {
	t.Parallel()
	var (
		nilDB   *sql.DB
		nilTx   *sql.Tx
		nilConn *sql.Conn
	)
	require.Nil(t, sqldb.Wrap(nil))
	require.Nil(t, sqldb.Wrap(nilDB))
	require.Nil(t, sqldb.Wrap(nilTx))
	require.Nil(t, sqldb.Wrap(nilConn))
	var nilEmbeds *embedsDB // the shape of *sqlx.DB
	require.Nil(t, sqldb.Wrap(nilEmbeds))
	lim, err := ratelimit.New(nil)
	require.NoError(t, err)
	for _, h := range []sqldb.Querier{nilDB, nilEmbeds} {
		_, err = lim.Limit(context.Background(), sqldb.Wrap(h), "msg", "u", &ratelimit.LimitOpts{Config: &ratelimit.Config{Rate: 1, Period: 1e9}})
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
	}

	db, _ := testdb.SQLDB(t, "pgx", false)
	_, err = lim.Limit(context.Background(), db, "msg", "u", &ratelimit.LimitOpts{Config: &ratelimit.Config{Rate: 1, Period: 1e9}})
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
	require.ErrorContains(t, err, "is a *sql.DB: pass a pgx.Tx, *pgxpool.Pool or *pgx.Conn, or wrap a database/sql handle with sqldb.Wrap")
}

// TestIsRetryableCallersStatement: a serialization failure of the caller's own statement (or
// commit) in a SERIALIZABLE *sql.Tx, which never went through Wrap, is retryable as
// ratelimit.IsRetryable says, with lib/pq (*pq.Error) as with the pgx stdlib driver.
func TestIsRetryableCallersStatement(t *testing.T) {
	t.Parallel()
	for _, driver := range testdb.SQLDrivers {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, pool := testdb.SQLDB(t, driver, false)
			_, err := pool.Exec(ctx, "CREATE TABLE counter (n int); INSERT INTO counter VALUES (0)")
			require.NoError(t, err)
			tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelSerializable})
			require.NoError(t, err)
			defer func() { _ = tx.Rollback() }()
			var n int
			require.NoError(t, tx.QueryRowContext(ctx, "SELECT n FROM counter").Scan(&n)) // takes the snapshot
			_, err = pool.Exec(ctx, "UPDATE counter SET n = n + 1")
			require.NoError(t, err)
			_, err = tx.ExecContext(ctx, "UPDATE counter SET n = n + 1")
			require.Error(t, err)
			require.True(t, ratelimit.IsRetryable(err), "%T: %v", err, err)
		})
	}
}
