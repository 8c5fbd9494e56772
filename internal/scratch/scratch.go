// Package scratch opens a pool on a throwaway schema with txlimit's migrations applied: for the
// runnable examples and programs, which can then be run again and again without leftovers.
package scratch

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/internal/pgtemp"
	"github.com/txlimit/txlimit/migrations"
)

// DefaultURL is the database used when neither DATABASE_URL nor TEST_DATABASE_URL is set.
const DefaultURL = "postgres://postgres@localhost:5432/test?sslmode=disable"

// EnvLocalURL names a URL probed instead of DefaultURL by OpenAny: set it to a closed port to make
// the examples start a private cluster on a machine where DefaultURL answers.
const EnvLocalURL = "TXLIMIT_LOCAL_URL"

// OpenAny is Open on the first database found: DATABASE_URL, else TEST_DATABASE_URL, else
// DefaultURL (or $TXLIMIT_LOCAL_URL) when it answers, else a private throwaway cluster
// (internal/pgtemp) when Postgres server binaries are installed. The returned function also stops
// and removes that cluster; if the program dies first, the cluster's watchdog does. When nothing is
// found, the error names the three ways to provide a database.
func OpenAny(ctx context.Context, prefix string, maxConns int32) (*pgxpool.Pool, func(), error) {
	for _, env := range []string{"DATABASE_URL", "TEST_DATABASE_URL"} {
		if v := os.Getenv(env); v != "" {
			return Open(ctx, v, prefix, maxConns)
		}
	}
	local := DefaultURL
	if v := os.Getenv(EnvLocalURL); v != "" {
		local = v
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	conn, localErr := pgx.Connect(pctx, local)
	cancel()
	if localErr == nil {
		_ = conn.Close(ctx)
		return Open(ctx, local, prefix, maxConns)
	}
	c, clusterErr := pgtemp.Start(ctx)
	if clusterErr != nil {
		return nil, nil, fmt.Errorf("no Postgres found. Tried, in order:\n  - DATABASE_URL and TEST_DATABASE_URL: not set\n  - %s: %v\n  - %v\n%s",
			local, localErr, clusterErr, pgtemp.Ways("DATABASE_URL"))
	}
	fmt.Fprintf(os.Stderr, "(no DATABASE_URL and nothing on %s: using a private throwaway Postgres at %s)\n", local, c.URL)
	pool, done, err := Open(ctx, c.URL, prefix, maxConns)
	if err != nil {
		_ = c.Stop()
		return nil, nil, err
	}
	return pool, func() { done(); _ = c.Stop() }, nil
}

// URL returns DATABASE_URL, else TEST_DATABASE_URL, else DefaultURL.
func URL() string {
	for _, env := range []string{"DATABASE_URL", "TEST_DATABASE_URL"} {
		if v := os.Getenv(env); v != "" {
			return v
		}
	}
	return DefaultURL
}

// Open creates a schema named prefix plus a random suffix on the database at url, opens a pool
// (at most maxConns connections; 0 means pgxpool's default) whose search_path is that schema, and
// applies txlimit's migrations in it. The returned function closes the pool and drops the schema.
func Open(ctx context.Context, url, prefix string, maxConns int32) (*pgxpool.Pool, func(), error) {
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := prefix + hex.EncodeToString(b[:])
	ident := pgx.Identifier{schema}.Sanitize()
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, nil, fmt.Errorf("connect (set DATABASE_URL): %w", err)
	}
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+ident); err != nil {
		_ = admin.Close(ctx)
		return nil, nil, err
	}
	drop := func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA "+ident+" CASCADE")
		_ = admin.Close(context.Background())
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		drop()
		return nil, nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		drop()
		return nil, nil, err
	}
	if err := migrations.Up(ctx, pool); err != nil {
		pool.Close()
		drop()
		return nil, nil, err
	}
	return pool, func() { pool.Close(); drop() }, nil
}
