// Package testdb gives tests a real, migrated Postgres schema of their own.
//
// The database is found (or started) once per test binary by package internal/devdb, whose doc
// says where it looks: TEST_DATABASE_URL, then localhost:5432, then a container, then a private
// throwaway cluster; when none works, the test fails with one message naming the three ways to
// provide a database. Each call to Pool creates a fresh schema, applies txlimit's migrations in it
// and drops it when the test ends, so tests can run in parallel without seeing each other's rows.
// RiverClient, RiverWorker and InsertScheduler make the River clients of the tests on such a pool.
package testdb

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3/lock"

	"github.com/txlimit/txlimit/internal/devdb"
	"github.com/txlimit/txlimit/migrations"
)

// schemaPrefix starts the name of every schema a test creates; ForExample's start with
// "txlimit_example_".
const schemaPrefix = "txlimit_test_"

var (
	dbOnce sync.Once
	db     *devdb.DB
	dbErr  error
)

// dsn returns the connection string of the test database, finding it on first use.
func dsn() (string, error) {
	dbOnce.Do(func() {
		// Never stopped here: a started database is removed when this binary ends.
		db, dbErr = devdb.Find(context.Background(), devdb.EnvTestURL)
		if dbErr != nil {
			dbErr = fmt.Errorf("testdb: %w", dbErr)
		}
	})
	if dbErr != nil {
		return "", dbErr
	}
	return db.URL, nil
}

// URL is DSN for code without a testing.TB: it returns the error DSN would fail the test with.
func URL() (string, error) { return dsn() }

// DSN returns the connection string of the test database, finding it on first use.
func DSN(tb testing.TB) string {
	tb.Helper()
	u, err := dsn()
	if err != nil {
		tb.Fatal(err)
	}
	return u
}

// Options tune Pool.
type Options struct {
	// MaxConns is the pool size. Defaults to 8.
	MaxConns int32
	// NoMigrate leaves the schema empty. Defaults to false.
	NoMigrate bool
	// Tracer is installed on every connection, e.g. to count statements. Defaults to none.
	Tracer pgx.QueryTracer
	// RuntimeParams are set on every connection (e.g. synchronous_commit), besides search_path.
	// Defaults to none.
	RuntimeParams map[string]string
	// QueryExecMode is pgx's DefaultQueryExecMode of every connection. Defaults to 0: pgx's
	// default (QueryExecModeCacheStatement).
	QueryExecMode pgx.QueryExecMode
}

// Pool returns a pool whose search_path is a new schema with txlimit's migrations applied. The
// pool is closed and the schema dropped when the test ends.
func Pool(tb testing.TB, opts *Options) *pgxpool.Pool {
	tb.Helper()
	if opts == nil {
		opts = &Options{}
	}
	pool, closeAll, err := devdb.OpenSchema(context.Background(), DSN(tb), devdb.SchemaName(schemaPrefix), &devdb.SchemaOpts{
		Configure: func(cfg *pgxpool.Config) {
			for k, v := range opts.RuntimeParams {
				cfg.ConnConfig.RuntimeParams[k] = v
			}
			cfg.MaxConns = 8
			if opts.MaxConns > 0 {
				cfg.MaxConns = opts.MaxConns
			}
			cfg.ConnConfig.Tracer = opts.Tracer
			if opts.QueryExecMode != 0 {
				cfg.ConnConfig.DefaultQueryExecMode = opts.QueryExecMode
			}
		},
		NoMigrate: opts.NoMigrate,
	})
	if err != nil {
		tb.Fatalf("testdb: %v", err)
	}
	cleanup(tb, closeAll)
	return pool
}

// NewSchema creates an empty schema with a random name and drops it (with everything in it) when
// the test ends. Tests that need the same schema from several pools use it with PoolOn.
func NewSchema(tb testing.TB) string {
	tb.Helper()
	schema := devdb.SchemaName(schemaPrefix)
	drop, err := devdb.CreateSchema(context.Background(), DSN(tb), schema)
	if err != nil {
		tb.Fatalf("testdb: %v", err)
	}
	cleanup(tb, drop)
	return schema
}

// HoldMigrationLock takes the migration lock of schema (which need not be migrated) the way
// another migrator would, with goose's table locker on the same row, through db (a pool whose
// search_path is schema). It returns the *sql.DB it holds the lock through and a function that
// releases the lock, which the test must call (before the test ends, or migrators wait for the
// lease).
func HoldMigrationLock(tb testing.TB, db *pgxpool.Pool, schema string) (*sql.DB, func()) {
	tb.Helper()
	sdb := stdlib.OpenDBFromPool(db)
	tb.Cleanup(func() { _ = sdb.Close() })
	l, err := lock.NewPostgresTableLocker(lock.WithTableName(migrations.LockTable), lock.WithTableLockID(migrations.LockID(schema)))
	if err != nil {
		tb.Fatalf("testdb: %v", err)
	}
	if err := l.Lock(context.Background(), sdb); err != nil {
		tb.Fatalf("testdb: take the migration lock: %v", err)
	}
	return sdb, func() {
		if err := l.Unlock(context.Background(), sdb); err != nil {
			tb.Errorf("testdb: release the migration lock: %v", err)
		}
	}
}

// cleanup calls f when the test ends and reports its error.
func cleanup(tb testing.TB, f func() error) {
	tb.Cleanup(func() {
		if err := f(); err != nil {
			tb.Errorf("testdb: %v", err)
		}
	})
}

// ForExample is Pool for runnable examples, which have no testing.TB: it returns a pool on a
// fresh migrated schema and a function that closes it and drops the schema. It panics when no
// database can be found, with the same message a test would fail with.
func ForExample() (*pgxpool.Pool, func()) { return ForExampleMode(0) }

// ForExampleMode is ForExample with mode as pgx's DefaultQueryExecMode of the pool (0: pgx's
// default, QueryExecModeCacheStatement).
func ForExampleMode(mode pgx.QueryExecMode) (*pgxpool.Pool, func()) {
	u, err := dsn()
	if err != nil {
		panic(err)
	}
	pool, closeAll, err := devdb.OpenSchema(context.Background(), u, devdb.SchemaName("txlimit_example_"), &devdb.SchemaOpts{
		Configure: func(cfg *pgxpool.Config) {
			if mode != 0 {
				cfg.ConnConfig.DefaultQueryExecMode = mode
			}
		},
	})
	if err != nil {
		panic(fmt.Errorf("testdb: %w", err))
	}
	return pool, func() { _ = closeAll() }
}
