package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/migrations"
)

// databaseURL returns DATABASE_URL, else TEST_DATABASE_URL, else a local default.
func databaseURL() string {
	for _, env := range []string{"DATABASE_URL", "TEST_DATABASE_URL"} {
		if v := os.Getenv(env); v != "" {
			return v
		}
	}
	return "postgres://postgres@localhost:5432/test?sslmode=disable"
}

// openScratch creates a schema named prefix plus a random suffix, opens a pool of at most
// maxConns connections whose search_path is that schema, and applies txlimit's migrations there.
// The returned function closes the pool and drops the schema. An application would instead
// connect to its own database and run migrations.Up and scheduler.Migrate at start-up.
func openScratch(ctx context.Context, url, prefix string, maxConns int32) (*pgxpool.Pool, func(), error) {
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := pgx.Identifier{prefix + hex.EncodeToString(b[:])}
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, nil, fmt.Errorf("connect (set DATABASE_URL): %w", err)
	}
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema.Sanitize()); err != nil {
		_ = admin.Close(ctx)
		return nil, nil, err
	}
	drop := func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA "+schema.Sanitize()+" CASCADE")
		_ = admin.Close(context.Background())
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		drop()
		return nil, nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema[0]
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = migrations.Up(ctx, pool)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		drop()
		return nil, nil, err
	}
	return pool, func() { pool.Close(); drop() }, nil
}
