package migrations_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/txlimit/txlimit/internal/pgbouncertest"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/ratelimit"
)

// objects lists the tables and functions of the pool's schema (its search_path).
func objects(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
		SELECT 'table ' || c.relname FROM pg_class c
		WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r'
		UNION ALL
		SELECT 'function ' || p.proname FROM pg_proc p
		WHERE p.pronamespace = current_schema()::regnamespace
		ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// provider returns migrations.NewProvider on pool, its *sql.DB closed when the test ends.
func provider(t *testing.T, pool *pgxpool.Pool) *goose.Provider {
	t.Helper()
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = db.Close() })
	p, err := migrations.NewProvider(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestDownAndUpAgain runs the migration's Down section: down to 0 leaves only goose's lock and
// version tables, and Up afterwards restores a working schema; in pgx's default exec mode and in
// each mode docs/deploy.md calls safe behind a transaction pooler.
func TestDownAndUpAgain(t *testing.T) {
	for _, m := range pgbouncertest.WithDefault() {
		t.Run(m.Name, func(t *testing.T) {
			ctx := context.Background()
			pool := testdb.Pool(t, &testdb.Options{QueryExecMode: m.Mode})
			p := provider(t, pool)
			sources := p.ListSources()
			last := sources[len(sources)-1].Version
			if v, err := p.GetDBVersion(ctx); err != nil || v != last {
				t.Fatalf("after Up: version %d, %v; want %d", v, err, last)
			}
			full := objects(t, pool)
			for _, want := range []string{
				"table txlimit_state", "table " + migrations.VersionTable, "table " + migrations.LockTable,
				// 00002: the rules
				"function txlimit_clock", "function txlimit_level", "function txlimit_next_ts", "function txlimit_charge",
				"function txlimit_left", "function txlimit_granted", "function txlimit_prunable", "function txlimit_grants_one",
				"function txlimit_estimate", "function txlimit_retry_at", "function txlimit_debt_until",
				// 00003: the decision
				"function txlimit_stale", "function txlimit_pack_v1", "function txlimit_written_v1", "function txlimit_steer",
				"function txlimit_lock_row", "function txlimit_answers", "function txlimit_alone", "function txlimit_decide_v1", "function txlimit_decide_one_v1",
				// 00004: the operations
				"function txlimit_levels_v1", "function txlimit_hold_shards", "function txlimit_credit_v1", "function txlimit_reset_v1",
			} {
				if !slices.Contains(full, want) {
					t.Errorf("after Up: no %s in %v", want, full)
				}
			}

			for range 2 {
				if _, err := p.DownTo(ctx, 0); err != nil {
					t.Fatalf("down to 0: %v", err)
				}
				if got := objects(t, pool); !slices.Equal(got, []string{"table " + migrations.LockTable, "table " + migrations.VersionTable}) {
					t.Errorf("after DownTo(0): %v; want only the lock and version tables", got)
				}
				if err := migrations.Up(ctx, pool); err != nil {
					t.Fatalf("Up again: %v", err)
				}
				if got := objects(t, pool); !slices.Equal(got, full) {
					t.Errorf("after Up again: %v; want %v", got, full)
				}
				lim, err := ratelimit.New(nil)
				if err != nil {
					t.Fatal(err)
				}
				res, err := lim.Limit(ctx, pool, "after", "up", &ratelimit.LimitOpts{Config: &ratelimit.Config{Rate: 1, Period: time.Second}})
				if err != nil || !res.OK {
					t.Errorf("a decision after Up again: %+v, %v", res, err)
				}
			}
		})
	}
}
