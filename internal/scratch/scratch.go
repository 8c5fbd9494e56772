// Package scratch opens a pool on a throwaway schema with txlimit's migrations applied, for the
// package examples (testdb.ForExample), which can then be run again and again without leftovers,
// and names the local database internal/cmd/withdb probes. The programs under examples/ import
// only public packages and do the same with migrations.Up (their db.go).
package scratch

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/migrations"
)

// DefaultURL is the database withdb probes when neither DATABASE_URL nor TEST_DATABASE_URL is set.
const DefaultURL = "postgres://postgres@localhost:5432/test?sslmode=disable"

// EnvLocalURL names a URL withdb probes instead of DefaultURL: set it to a closed port to make it
// start a private cluster on a machine where DefaultURL answers.
const EnvLocalURL = "TXLIMIT_LOCAL_URL"

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
