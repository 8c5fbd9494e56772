// Package migrations holds txlimit's schema as goose migrations embedded in the binary.
//
// The migrations keep their own goose version table, txlimit_goose_version, so they never touch an
// application's goose_db_version. Tables are created in the first schema of the connection's
// search_path, the same schema the library's queries use.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"hash/fnv"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed *.sql
var FS embed.FS

// VersionTable is the name of the goose version table these migrations keep.
const VersionTable = "txlimit_goose_version"

// NewProvider returns a goose Provider for txlimit's migrations on db, with txlimit's own version
// table and a Postgres session lock so that concurrent migrators of the same schema wait for each
// other. The lock is txlimit's own, per schema (goose's default is one lock for the whole database,
// shared with the application's goose): migrating one schema never waits for another. Use the
// Provider for anything beyond Up: status, down, a target version.
func NewProvider(ctx context.Context, db *sql.DB) (*goose.Provider, error) {
	var schema string
	if err := db.QueryRowContext(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
		return nil, fmt.Errorf("migrations: find the schema: %w", err)
	}
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(LockID(schema)), lock.WithLockTimeout(1, 300))
	if err != nil {
		return nil, err
	}
	return goose.NewProvider(goose.DialectPostgres, db, FS,
		goose.WithTableName(VersionTable),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
	)
}

// Up applies every pending migration through the pool. It is safe to call at every start-up and
// from several processes at once.
func Up(ctx context.Context, pool *pgxpool.Pool) error {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	p, err := NewProvider(ctx, db)
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	if _, err := p.Up(ctx); err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	return nil
}

// LockID is the Postgres advisory lock ID that NewProvider's migrations hold while they run in
// schema: a 64-bit FNV-1a hash of "txlimit migrations" and the schema name.
func LockID(schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("txlimit migrations\x00"))
	h.Write([]byte(schema))
	return int64(h.Sum64())
}
