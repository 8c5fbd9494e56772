package scheduler

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// MigrateOpts are the options of Migrate. A nil *MigrateOpts is the zero value.
type MigrateOpts struct {
	// Logger receives River's migration log. Defaults to nil: River's default, which writes
	// warnings and errors to stdout.
	Logger *slog.Logger

	// Schema is the schema River's tables go in; it must exist. Defaults to "": the first schema of
	// the connection's search_path, where txlimit's migrations put txlimit_state.
	Schema string
}

// Migrate brings River's tables (river_job, river_leader, ...) up to the version of River this
// module is built with, by running River's own migrator (rivermigrate) on pool; it is a no-op when
// they are current. It is a separate step from txlimit's migrations.Up because River's schema is
// versioned with River, in its own table river_migration: upgrading River upgrades what Migrate
// applies, with nothing copied into this module.
//
// River's migrator takes no lock, so two processes migrating the same schema at once can collide;
// run it from one place (a deploy step, or at start-up of one instance).
func Migrate(ctx context.Context, pool *pgxpool.Pool, opts *MigrateOpts) error {
	if pool == nil {
		return argError("Migrate", "pool", "is nil: pass the *pgxpool.Pool to migrate", nil)
	}
	if opts == nil {
		opts = &MigrateOpts{}
	}
	m, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: opts.Logger, Schema: opts.Schema})
	if err != nil {
		return fmt.Errorf("scheduler: Migrate: %w", err)
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("scheduler: Migrate: %w", err)
	}
	return nil
}
