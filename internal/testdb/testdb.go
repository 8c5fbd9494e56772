// Package testdb gives tests a real, migrated Postgres schema of their own.
//
// The database is found, once per test binary, in this order:
//  1. TEST_DATABASE_URL, when set;
//  2. a Postgres container started with testcontainers, when a Docker daemon answers;
//  3. Postgres on localhost:5432 (user postgres, database test, no password), when it accepts a
//     connection (TXLIMIT_LOCAL_URL names another URL to probe instead: set it to a closed port,
//     e.g. postgres://postgres@127.0.0.1:1/test, to skip this step on a machine where it answers);
//  4. a private throwaway cluster (package internal/pgtemp), when Postgres server binaries are
//     installed (initdb and pg_ctl on $PATH or under /usr/lib/postgresql/*/bin): one per test
//     binary, in a temporary directory on a free loopback port, stopped and removed when the binary
//     ends however it ends (TXLIMIT_PRIVATE_CLUSTER=off skips this step);
//
// and otherwise the test fails with one message naming the three ways to provide a database. Each
// call to Pool creates a fresh schema, applies txlimit's migrations in it and drops it when the
// test ends, so tests can run in parallel without seeing each other's rows.
package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"

	"github.com/txlimit/txlimit/internal/pgtemp"
	"github.com/txlimit/txlimit/internal/scratch"
	"github.com/txlimit/txlimit/migrations"
)

// EnvURL is the environment variable that names the test database.
const EnvURL = "TEST_DATABASE_URL"

// LocalURL is the database tried when neither EnvURL nor Docker is available.
const LocalURL = "postgres://postgres@localhost:5432/test?sslmode=disable"

// EnvLocalURL names the URL probed instead of LocalURL. Set it to a closed port to make the tests
// start a private cluster on a machine where LocalURL answers.
const EnvLocalURL = "TXLIMIT_LOCAL_URL"

var (
	dsnOnce sync.Once
	dsn     string
	dsnErr  error
	dsnFrom string
)

// DSN returns the connection string of the test database, finding it on first use.
func DSN(tb testing.TB) string {
	tb.Helper()
	dsnOnce.Do(func() { dsn, dsnFrom, dsnErr = find() })
	if dsnErr != nil {
		tb.Fatal(dsnErr)
	}
	return dsn
}

// Source says where the DSN came from: "TEST_DATABASE_URL", "testcontainers", "localhost" or
// "private cluster".
func Source() string { return dsnFrom }

func find() (string, string, error) {
	if u := os.Getenv(EnvURL); u != "" {
		return u, EnvURL, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dockerErr := dockerAnswers(ctx)
	if dockerErr == nil {
		u, err := startContainer(ctx)
		if err == nil {
			return u, "testcontainers", nil
		}
		dockerErr = err
	}
	local := LocalURL
	if u := os.Getenv(EnvLocalURL); u != "" {
		local = u
	}
	localErr := ping(ctx, local)
	if localErr == nil {
		return local, "localhost", nil
	}
	c, clusterErr := pgtemp.Start(ctx)
	if clusterErr == nil {
		// Never stopped here: the cluster's watchdog stops it and removes it when this binary ends.
		return c.URL, "private cluster", nil
	}
	return "", "", fmt.Errorf("testdb: no Postgres for tests. Tried, in order:\n"+
		"  - %s: not set\n  - testcontainers: %v\n  - %s: %v\n  - %v\n%s",
		EnvURL, dockerErr, local, localErr, clusterErr, pgtemp.Ways(EnvURL))
}

func dockerAnswers(ctx context.Context) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("docker client panicked: %v", r)
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	cli, err := testcontainers.NewDockerClientWithOpts(ctx)
	if err != nil {
		return fmt.Errorf("no Docker daemon answers: %w", err)
	}
	defer cli.Close()
	return nil
}

func startContainer(ctx context.Context) (string, error) {
	c, err := tcpostgres.Run(ctx, "postgres:15-alpine",
		tcpostgres.WithDatabase("test"),
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies(),
	)
	if err != nil {
		return "", fmt.Errorf("starting a Postgres container: %w", err)
	}
	// The container lives as long as the test binary; testcontainers' reaper removes it after.
	return c.ConnectionString(ctx, "sslmode=disable")
}

func ping(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx)
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
}

// Pool returns a pool whose search_path is a new schema with txlimit's migrations applied. The
// pool is closed and the schema dropped when the test ends.
func Pool(tb testing.TB, opts *Options) *pgxpool.Pool {
	tb.Helper()
	if opts == nil {
		opts = &Options{}
	}
	ctx := context.Background()
	schema := NewSchema(tb)
	cfg, err := pgxpool.ParseConfig(DSN(tb))
	if err != nil {
		tb.Fatalf("testdb: parse DSN: %v", err)
	}
	for k, v := range opts.RuntimeParams {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = 8
	if opts.MaxConns > 0 {
		cfg.MaxConns = opts.MaxConns
	}
	cfg.ConnConfig.Tracer = opts.Tracer
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("testdb: connect: %v", err)
	}
	tb.Cleanup(pool.Close)
	if !opts.NoMigrate {
		if err := migrations.Up(ctx, pool); err != nil {
			tb.Fatalf("testdb: migrate schema %s: %v", schema, err)
		}
	}
	return pool
}

// NewSchema creates an empty schema with a random name and drops it (with everything in it) when
// the test ends. Tests that need the same schema from several pools use it with SearchPath.
func NewSchema(tb testing.TB) string {
	tb.Helper()
	ctx := context.Background()
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "txlimit_test_" + hex.EncodeToString(b[:])
	conn, err := pgx.Connect(ctx, DSN(tb))
	if err != nil {
		tb.Fatalf("testdb: connect: %v", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		tb.Fatalf("testdb: create schema: %v", err)
	}
	tb.Cleanup(func() {
		conn, err := pgx.Connect(context.Background(), DSN(tb))
		if err != nil {
			tb.Errorf("testdb: connect to drop schema %s: %v", schema, err)
			return
		}
		defer conn.Close(context.Background())
		if _, err := conn.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			tb.Errorf("testdb: drop schema %s: %v", schema, err)
		}
	})
	return schema
}

// ForExample is Pool for runnable examples, which have no testing.TB: it returns a pool on a
// fresh migrated schema and a function that closes it and drops the schema. It panics when no
// database can be found, with the same message a test would fail with.
func ForExample() (*pgxpool.Pool, func()) {
	dsnOnce.Do(func() { dsn, dsnFrom, dsnErr = find() })
	if dsnErr != nil {
		panic(dsnErr)
	}
	pool, done, err := scratch.Open(context.Background(), dsn, "txlimit_example_", 0)
	if err != nil {
		panic(err)
	}
	return pool, done
}
