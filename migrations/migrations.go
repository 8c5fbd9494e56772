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
// table and a Postgres session lock so that concurrent migrators wait for each other. Use it for
// anything beyond Up: status, down, a target version.
func NewProvider(db *sql.DB) (*goose.Provider, error) {
	locker, err := lock.NewPostgresSessionLocker()
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
	p, err := NewProvider(db)
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	if _, err := p.Up(ctx); err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	return nil
}
