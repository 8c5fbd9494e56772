package scheduler_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/pgbouncertest"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/scheduler"
)

// The connection of the package run: how every test, the benchmark and the examples reach
// Postgres. TestMain reads two environment variables once; make test runs the package in each
// safe mode directly, make test-pgbouncer in each through PgBouncer:
//
//   - TXLIMIT_TEST_EXEC_MODE: the pools' pgx exec mode, one of pgbouncertest.SafeModes (exec,
//     simple_protocol, cache_describe: the modes docs/deploy.md calls safe behind a transaction
//     pooler); unset or empty, pgx's default (cache_statement).
//   - TXLIMIT_TEST_VIA: direct (or unset or empty) or pgbouncer, through the PgBouncer of
//     TXLIMIT_PGBOUNCER_URL (pgbouncertest.EnvURL), which must then be set, as must a safe mode.
//
// Any other value fails the run before a test starts.
const (
	envExecMode = "TXLIMIT_TEST_EXEC_MODE"
	envVia      = "TXLIMIT_TEST_VIA"
)

// runConn is the connection of the package run, set by TestMain from the environment.
var runConn conn

func TestMain(m *testing.M) {
	c, err := connFromEnv(os.Getenv)
	if err != nil {
		fmt.Fprintf(os.Stderr, "scheduler tests: %v\n", err)
		os.Exit(2)
	}
	runConn = c
	fmt.Printf("scheduler tests: %s\n", c)
	os.Exit(m.Run())
}

// conn is how the tests reach Postgres: directly or through PgBouncer, in one pgx exec mode.
type conn struct {
	mode    pgbouncertest.Mode // the zero Mode: pgx's default (cache_statement)
	bouncer bool
}

func (c conn) String() string {
	mode := "pgx's default exec mode (cache_statement)"
	if c.mode.Name != "" {
		mode = "exec mode " + c.mode.Name
	}
	if c.bouncer {
		return mode + ", through PgBouncer (" + pgbouncertest.EnvURL + ")"
	}
	return mode + ", directly"
}

// connFromEnv returns the connection that the environment, read with getenv, chooses, or an error
// naming the variable and the values it takes.
func connFromEnv(getenv func(string) string) (conn, error) {
	var c conn
	if name := getenv(envExecMode); name != "" {
		var names []string
		for _, m := range pgbouncertest.SafeModes {
			names = append(names, m.Name)
			if m.Name == name {
				c.mode = m
			}
		}
		if c.mode.Name == "" {
			return conn{}, fmt.Errorf("%s=%q: want one of %s, or unset for pgx's default mode", envExecMode, name, strings.Join(names, ", "))
		}
	}
	switch via := getenv(envVia); via {
	case "", "direct":
	case "pgbouncer":
		if c.mode.Name == "" {
			return conn{}, fmt.Errorf("%s=pgbouncer needs %s: pgx's default mode prepares named statements, which PgBouncer breaks in transaction pooling mode (docs/deploy.md)", envVia, envExecMode)
		}
		if getenv(pgbouncertest.EnvURL) == "" {
			return conn{}, fmt.Errorf("%s=pgbouncer needs %s, the test database's URL through PgBouncer: make test-pgbouncer starts one and sets it", envVia, pgbouncertest.EnvURL)
		}
		c.bouncer = true
	default:
		return conn{}, fmt.Errorf("%s=%q: want direct or pgbouncer", envVia, via)
	}
	return c, nil
}

// TestMakefileListsEverySafeMode: the Makefile's SAFE_MODES, the modes make test and make
// test-pgbouncer run this package in, are the names of pgbouncertest.SafeModes, in their order.
func TestMakefileListsEverySafeMode(t *testing.T) {
	t.Parallel()
	text, err := os.ReadFile("../Makefile")
	require.NoError(t, err)
	var listed []string
	for line := range strings.Lines(string(text)) {
		if rest, ok := strings.CutPrefix(line, "SAFE_MODES := "); ok {
			listed = strings.Fields(rest)
		}
	}
	var names []string
	for _, m := range pgbouncertest.SafeModes {
		names = append(names, m.Name)
	}
	require.Equal(t, names, listed, "SAFE_MODES in the Makefile")
}

// tables is what the schema of a pool holds.
type tables int

const (
	allTables     tables = iota // txlimit's and River's (scheduler.Migrate)
	txlimitTables               // txlimit's only
	noTables                    // none: an empty schema
)

// pool returns a pool of at most maxConns connections, reached by c, on a schema of the test's own
// that holds schema's tables, dropped when the test ends. Through PgBouncer the schema is the
// search_path of a role of the test's own (pgbouncertest.New).
func (c conn) pool(tb testing.TB, maxConns int32, schema tables) *pgxpool.Pool {
	tb.Helper()
	ctx := context.Background()
	var pool *pgxpool.Pool
	if c.bouncer {
		pool = pgbouncertest.New(tb).Pool(tb, c.mode.Mode, maxConns)
		if schema != noTables {
			require.NoError(tb, migrations.Up(ctx, pool))
		}
	} else {
		pool = testdb.Pool(tb, &testdb.Options{MaxConns: maxConns, QueryExecMode: c.mode.Mode, NoMigrate: schema == noTables})
	}
	if schema == allTables {
		require.NoError(tb, scheduler.Migrate(ctx, pool, nil))
	}
	return pool
}

// examplePool is testdb.ForExample reached by the run's connection, for the runnable examples: a
// pool on a fresh schema with txlimit's migrations, and a function that closes the pool and drops
// the schema. It panics where a test would fail.
func examplePool() (*pgxpool.Pool, func()) {
	if !runConn.bouncer {
		return testdb.ForExampleMode(runConn.mode.Mode)
	}
	ctx := context.Background()
	b, drop, err := pgbouncertest.Open(ctx)
	if err != nil {
		panic(err)
	}
	pool, err := b.Connect(ctx, runConn.mode.Mode, 4)
	if err != nil {
		panic(errors.Join(err, drop()))
	}
	done := func() {
		pool.Close()
		if err := drop(); err != nil {
			panic(err)
		}
	}
	if err := migrations.Up(ctx, pool); err != nil {
		done()
		panic(err)
	}
	return pool, done
}

// TestConnFromEnv: the run's connection is pgx's default mode directly, or one of the safe modes
// directly or through PgBouncer; any other value is an error that names the variable.
func TestConnFromEnv(t *testing.T) {
	t.Parallel()
	env := func(kv ...string) func(string) string {
		return func(k string) string {
			for i := 0; i < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1]
				}
			}
			return ""
		}
	}
	const url = "postgres://127.0.0.1:6432/test"
	for i, c := range []struct {
		env     func(string) string
		want    conn
		wantErr string
	}{
		{env: env(), want: conn{}},
		{env: env(envVia, "direct"), want: conn{}},
		{env: env(envExecMode, "exec"), want: conn{mode: pgbouncertest.SafeModes[0]}},
		{env: env(envExecMode, "cache_describe", envVia, "direct"), want: conn{mode: pgbouncertest.SafeModes[2]}},
		{env: env(envExecMode, "simple_protocol", envVia, "pgbouncer", pgbouncertest.EnvURL, url), want: conn{mode: pgbouncertest.SafeModes[1], bouncer: true}},
		{env: env(envExecMode, "simple"), wantErr: `TXLIMIT_TEST_EXEC_MODE="simple": want one of exec, simple_protocol, cache_describe, or unset for pgx's default mode`},
		{env: env(envExecMode, "describe_exec"), wantErr: `TXLIMIT_TEST_EXEC_MODE="describe_exec": want one of`},
		{env: env(envVia, "bouncer"), wantErr: `TXLIMIT_TEST_VIA="bouncer": want direct or pgbouncer`},
		{env: env(envVia, "pgbouncer", pgbouncertest.EnvURL, url), wantErr: "TXLIMIT_TEST_VIA=pgbouncer needs TXLIMIT_TEST_EXEC_MODE"},
		{env: env(envExecMode, "exec", envVia, "pgbouncer"), wantErr: "TXLIMIT_TEST_VIA=pgbouncer needs TXLIMIT_PGBOUNCER_URL"},
	} {
		got, err := connFromEnv(c.env)
		if c.wantErr != "" {
			require.ErrorContains(t, err, c.wantErr, "case %d", i)
			continue
		}
		require.NoError(t, err, "case %d", i)
		require.Equal(t, c.want, got, "case %d", i)
	}
}
