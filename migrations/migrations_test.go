package migrations_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/migrations"
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

// TestDownAndUpAgain runs every migration's Down section: down one step removes what the last
// migration added, down to 0 leaves only goose's version table, and Up afterwards restores a
// working schema.
func TestDownAndUpAgain(t *testing.T) {
	ctx := context.Background()
	pool := testdb.Pool(t, nil)
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	sources := p.ListSources()
	last := sources[len(sources)-1].Version
	if v, err := p.GetDBVersion(ctx); err != nil || v != last {
		t.Fatalf("after Up: version %d, %v; want %d", v, err, last)
	}
	full := objects(t, pool)
	for _, want := range []string{
		"table txlimit_state", "table " + migrations.VersionTable, "table " + migrations.LockTable,
		"function txlimit_level", "function txlimit_next_ts", "function txlimit_charge",
		"function txlimit_left", "function txlimit_decide_sharded",
	} {
		if !slices.Contains(full, want) {
			t.Errorf("after Up: no %s in %v", want, full)
		}
	}

	if _, err := p.Down(ctx); err != nil {
		t.Fatalf("down one: %v", err)
	}
	if got := objects(t, pool); slices.Contains(got, "function txlimit_decide_sharded") || len(got) != len(full)-1 {
		t.Errorf("after one Down: %v; want %v without txlimit_decide_sharded", got, full)
	}

	if _, err := p.DownTo(ctx, 0); err != nil {
		t.Fatalf("down to 0: %v", err)
	}
	if got := objects(t, pool); !slices.Equal(got, []string{"table " + migrations.LockTable, "table " + migrations.VersionTable}) {
		t.Errorf("after DownTo(0): %v; want only the lock and version tables", got)
	}

	if err := migrations.Up(ctx, pool); err != nil {
		t.Fatalf("Up again: %v", err)
	}
	if got := objects(t, pool); len(got) != len(full) {
		t.Errorf("after Up again: %v; want %v", got, full)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM txlimit_state WHERE name = ''").Scan(&n); err != nil || n != 1000 {
		t.Errorf("planner ballast after Up again: %d rows, %v; want 1000", n, err)
	}
}
