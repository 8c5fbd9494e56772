package main

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/migrations"
)

// openDB connects to DATABASE_URL with a new schema, named prefix plus a random suffix, as its
// search_path, migrates txlimit into it (migrations.Up creates the schema), says which database
// and schema it uses (never a password), and returns a function that drops the schema and closes
// the pool. maxConns bounds the pool; 0 is pgxpool's default. An application connects to its own
// database and schema instead, and runs migrations.Up at start-up.
func openDB(ctx context.Context, prefix string, maxConns int32) (*pgxpool.Pool, func(), error) {
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		return nil, nil, errors.New("set DATABASE_URL to a Postgres, e.g. postgres://postgres@localhost:5432/postgres " +
			"(make demo sets it: it finds or starts one)")
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	schema := prefix + strings.ToLower(rand.Text()[:8])
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	drop := func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		pool.Close()
	}
	if err := migrations.Up(ctx, pool, migrations.CreateSchema()); err != nil {
		drop()
		return nil, nil, fmt.Errorf("migrate: %w", err)
	}
	c := cfg.ConnConfig
	fmt.Printf("database %s:%d/%s, schema %s (migrated now, dropped at the end)\n", c.Host, c.Port, c.Database, schema)
	return pool, drop, nil
}
