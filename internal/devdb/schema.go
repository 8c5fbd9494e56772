package devdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/migrations"
)

// dropWait bounds the drop of a schema, which runs when its user is done, often without a context.
const dropWait = 30 * time.Second

// SchemaName returns prefix followed by 12 random hexadecimal digits: the name of a schema no
// other run uses. prefix has no default; it should be a lower-case identifier such as
// "txlimit_test_".
func SchemaName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// CreateSchema creates schema on the database at url, after dropping a schema of that name with
// everything in it (one left by an interrupted run), and returns a function that drops it again.
// Each opens a connection of its own for the moment, so the schema's users may close theirs first.
func CreateSchema(ctx context.Context, url, schema string) (drop func() error, err error) {
	ident := pgx.Identifier{schema}.Sanitize()
	if err := exec(ctx, url, "DROP SCHEMA IF EXISTS "+ident+" CASCADE", "CREATE SCHEMA "+ident); err != nil {
		return nil, fmt.Errorf("create schema %s: %w", schema, err)
	}
	return func() error {
		ctx, cancel := context.WithTimeout(context.Background(), dropWait)
		defer cancel()
		if err := exec(ctx, url, "DROP SCHEMA IF EXISTS "+ident+" CASCADE"); err != nil {
			return fmt.Errorf("drop schema %s: %w", schema, err)
		}
		return nil
	}, nil
}

// exec runs the statements one after the other on a new connection to url.
func exec(ctx context.Context, url string, statements ...string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	for _, s := range statements {
		if _, err := conn.Exec(ctx, s); err != nil {
			return err
		}
	}
	return nil
}

// SchemaOpts tune OpenSchema. A nil *SchemaOpts is the zero value.
type SchemaOpts struct {
	// Configure edits the pool's configuration before the pool is opened: its size, a tracer,
	// run-time parameters (a search_path it sets is replaced by the schema). Defaults to nil:
	// pgxpool's defaults.
	Configure func(*pgxpool.Config)
	// NoMigrate leaves the schema empty. Defaults to false: txlimit's migrations are applied.
	NoMigrate bool
}

// OpenSchema creates schema on the database at url as CreateSchema does, opens a pool whose
// search_path is that schema and applies txlimit's migrations in it. closeAll closes the pool, then
// drops the schema.
func OpenSchema(ctx context.Context, url, schema string, opts *SchemaOpts) (pool *pgxpool.Pool, closeAll func() error, err error) {
	if opts == nil {
		opts = &SchemaOpts{}
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, nil, fmt.Errorf("parse the database URL: %w", err)
	}
	if opts.Configure != nil {
		opts.Configure(cfg)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	drop, err := CreateSchema(ctx, url, schema)
	if err != nil {
		return nil, nil, err
	}
	pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, errors.Join(fmt.Errorf("open a pool: %w", err), drop())
	}
	closeAll = func() error {
		pool.Close()
		return drop()
	}
	if !opts.NoMigrate {
		if err := migrations.Up(ctx, pool); err != nil {
			return nil, nil, errors.Join(fmt.Errorf("migrate schema %s: %w", schema, err), closeAll())
		}
	}
	return pool, closeAll, nil
}
