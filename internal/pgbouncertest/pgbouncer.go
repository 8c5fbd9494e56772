package pgbouncertest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/internal/testdb"
)

// EnvURL names the URL of the test database through PgBouncer. Tests that need it are skipped
// without it; make test-pgbouncer sets it (.ci/pgbouncer.sh).
const EnvURL = "TXLIMIT_PGBOUNCER_URL"

// Mode is a pgx exec mode and the name tests give it.
type Mode struct {
	// Name is the mode's name in test names, e.g. "simple_protocol".
	Name string
	// Mode is the pool's pgx.ConnConfig.DefaultQueryExecMode.
	Mode pgx.QueryExecMode
}

// SafeModes are the pgx exec modes docs/deploy.md calls safe behind a transaction-mode pooler:
// exec, simple protocol and cache describe. TestExecModes checks that the decisions work in each
// through PgBouncer; the scheduler's whole test suite runs in each, directly on Postgres (make
// test) and through PgBouncer (make test-pgbouncer), chosen by name (TXLIMIT_TEST_EXEC_MODE; the
// Makefile's SAFE_MODES lists the names).
var SafeModes = []Mode{
	{Name: "exec", Mode: pgx.QueryExecModeExec},
	{Name: "simple_protocol", Mode: pgx.QueryExecModeSimpleProtocol},
	{Name: "cache_describe", Mode: pgx.QueryExecModeCacheDescribe},
}

// WithDefault returns pgx's default mode (the zero Mode, QueryExecModeCacheStatement, named
// "default") followed by SafeModes: the modes a test that runs directly on Postgres loops over.
func WithDefault() []Mode { return append([]Mode{{Name: "default"}}, SafeModes...) }

// Bouncer is one test's place behind PgBouncer: a role of its own whose search_path is a schema it
// owns, set with ALTER ROLE (PgBouncer 1.18 refuses search_path as a startup parameter), as
// docs/deploy.md tells users to do. The role and its schema are dropped when the test ends.
type Bouncer struct {
	// URL is PgBouncer's URL of the test database, as EnvURL gives it; Pool connects through it
	// as Role.
	URL string
	// Role is the role the test connects as; its search_path is Schema.
	Role string
	// Schema is the role's schema, empty at first.
	Schema string
}

// New creates a role and its schema for the test and returns its place behind PgBouncer, dropped
// when the test ends. It skips the test when EnvURL is not set.
func New(tb testing.TB) *Bouncer {
	tb.Helper()
	if os.Getenv(EnvURL) == "" {
		tb.Skipf("%s is not set: run make test-pgbouncer", EnvURL)
	}
	b, drop, err := Open(context.Background())
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := drop(); err != nil {
			tb.Error(err)
		}
	})
	return b
}

// Open is New for code without a testing.TB (runnable examples): it creates the role and its
// schema and returns their place behind PgBouncer and a function that drops them. It fails when
// EnvURL is not set.
func Open(ctx context.Context) (b *Bouncer, drop func() error, err error) {
	base := os.Getenv(EnvURL)
	if base == "" {
		return nil, nil, fmt.Errorf("pgbouncertest: %s is not set: run make test-pgbouncer", EnvURL)
	}
	cfg, err := pgx.ParseConfig(base)
	if err != nil {
		return nil, nil, fmt.Errorf("pgbouncertest: %s: %w", EnvURL, err)
	}
	adminURL, err := testdb.URL()
	if err != nil {
		return nil, nil, err
	}
	var r [6]byte
	_, _ = rand.Read(r[:])
	role := "txlimit_pgb_" + hex.EncodeToString(r[:])
	admin, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return nil, nil, fmt.Errorf("pgbouncertest: %w", err)
	}
	if _, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN"); err != nil {
		_ = admin.Close(ctx)
		return nil, nil, fmt.Errorf("pgbouncertest: create role %s: %w", role, err)
	}
	drop = func() error {
		ctx := context.Background()
		defer admin.Close(ctx)
		// PgBouncer keeps server connections of the role open: end them, then drop what it owns.
		_, _ = admin.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role)
		var errs []error
		for _, sql := range []string{"DROP SCHEMA IF EXISTS " + role + " CASCADE", "DROP OWNED BY " + role, "DROP ROLE " + role} {
			if _, err := admin.Exec(ctx, sql); err != nil {
				errs = append(errs, fmt.Errorf("pgbouncertest: %s: %w", sql, err))
			}
		}
		return errors.Join(errs...)
	}
	for _, sql := range []string{
		"CREATE SCHEMA " + role + " AUTHORIZATION " + role,
		"ALTER ROLE " + role + " SET search_path = " + role,
	} {
		if _, err := admin.Exec(ctx, sql); err != nil {
			return nil, nil, errors.Join(fmt.Errorf("pgbouncertest: %s: %w", sql, err), drop())
		}
	}
	cfg.User = role
	return &Bouncer{URL: cfg.ConnString(), Role: role, Schema: role}, drop, nil
}

// Pool opens a pool through PgBouncer as the test's role, with mode as its exec mode and at most
// maxConns connections, closed when the test ends.
func (b *Bouncer) Pool(tb testing.TB, mode pgx.QueryExecMode, maxConns int32) *pgxpool.Pool {
	tb.Helper()
	pool, err := b.Connect(context.Background(), mode, maxConns)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// Connect is Pool for code without a testing.TB: the caller closes the pool.
func (b *Bouncer) Connect(ctx context.Context, mode pgx.QueryExecMode, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(b.URL)
	if err != nil {
		return nil, fmt.Errorf("pgbouncertest: %w", err)
	}
	cfg.ConnConfig.User = b.Role
	cfg.ConnConfig.DefaultQueryExecMode = mode
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("pgbouncertest: %w", err)
	}
	return pool, nil
}
