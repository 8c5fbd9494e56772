package testdb

import (
	"log/slog"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertest"
	"github.com/riverqueue/river/rivertype"

	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// SearchPath returns the search_path of db's connection.
func SearchPath(tb testing.TB, db Querier) string {
	tb.Helper()
	return scalar[string](tb, db, "search_path", "SELECT current_setting('search_path')")
}

// RiverClient returns a River client of config cfg on pool, through River's pgx driver, failing tb
// when River refuses the config. The scheduler's tests add scheduler.PreciseHook to cfg.Hooks
// themselves: some test a client without it.
func RiverClient(tb testing.TB, pool *pgxpool.Pool, cfg *river.Config) *river.Client[pgx.Tx] {
	tb.Helper()
	client, err := river.NewClient(riverpgxv5.New(pool), cfg)
	if err != nil {
		tb.Fatalf("testdb: river.NewClient: %v", err)
	}
	return client
}

// RiverWorker returns rivertest's worker of w with config cfg, on pool through River's pgx driver
// (pool may be nil when the jobs are worked in a test's transaction only).
func RiverWorker[T river.JobArgs](tb testing.TB, pool *pgxpool.Pool, cfg *river.Config, w river.Worker[T]) *rivertest.Worker[T, pgx.Tx] {
	tb.Helper()
	return rivertest.NewWorker(tb, riverpgxv5.New(pool), cfg, w)
}

// InsertScheduler returns a Scheduler of config cfg (nil: the defaults) on lim, and its River
// client on pool: a client without Workers, so it inserts jobs of any kind and works none, with
// scheduler.PreciseHook, River's log discarded.
func InsertScheduler(tb testing.TB, pool *pgxpool.Pool, lim *ratelimit.Limiter, cfg *scheduler.Config) (*river.Client[pgx.Tx], *scheduler.Scheduler) {
	tb.Helper()
	client := RiverClient(tb, pool, &river.Config{
		Hooks:  []rivertype.Hook{&scheduler.PreciseHook{}},
		Logger: slog.New(slog.DiscardHandler),
	})
	sched, err := scheduler.New(client, lim, cfg)
	if err != nil {
		tb.Fatalf("testdb: scheduler.New: %v", err)
	}
	return client, sched
}
