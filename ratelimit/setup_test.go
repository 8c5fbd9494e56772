package ratelimit_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/ratelimit"
)

// requireSetupError checks that err is a *SetupError of op naming migrations.Up and searchPath,
// with Postgres's error (SQLSTATE code, one of "42P01|42883", or none when code is "") reachable,
// and that its message is want: the fix first, then what is missing, never a function's argument
// types (issue 31).
func requireSetupError(t *testing.T, step string, err error, op, searchPath, code, want string) {
	t.Helper()
	var se *ratelimit.SetupError
	if !errors.As(err, &se) || !errors.Is(err, ratelimit.ErrSetup) {
		t.Fatalf("%s: got %v (%T); want a *ratelimit.SetupError", step, err, err)
	}
	if errors.Is(err, ratelimit.ErrInvalid) {
		t.Errorf("%s: a set-up error matches ErrInvalid", step)
	}
	if se.Op != op || se.SearchPath != searchPath || se.Fix != "migrations.Up" {
		t.Errorf("%s: Op %q, SearchPath %q, Fix %q; want %q, %q, migrations.Up", step, se.Op, se.SearchPath, se.Fix, op, searchPath)
	}
	if got := err.Error(); got != want {
		t.Errorf("%s: message\n got %s\nwant %s", step, got, want)
	}
	var pgErr *pgconn.PgError
	if code == "" {
		if errors.As(err, &pgErr) {
			t.Errorf("%s: a PgError (%v) is reachable; want none", step, pgErr)
		}
		return
	}
	if !errors.As(err, &pgErr) || !strings.Contains(code, pgErr.Code) {
		t.Errorf("%s: PgError %v; want SQLSTATE %s reachable with errors.As", step, pgErr, code)
	}
}

// missingIn is the message of a *SetupError of op for a missing object (Postgres's message without
// argument types) in search_path searchPath.
func missingIn(op, missing, code, searchPath string) string {
	return "ratelimit: " + op + ": run migrations.Up(ctx, pool) at start-up with this search_path (adding migrations.CreateSchema() if its schema does not exist yet), or set search_path to the schema it ran in: " +
		missing + ` in search_path "` + searchPath + `" (SQLSTATE ` + code + "; see docs/deploy.md)"
}

// TestSetupErrors: each set-up mistake gives a *SetupError naming the fix and the search_path: a
// forgotten migration (every call, CheckSchema, and inside a transaction, where the search_path
// cannot be read any more), a search_path naming another schema, and a schema behind this build.
func TestSetupErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"a":       {Rate: 1, Period: time.Second},
		"sharded": {Rate: 8, Period: time.Second, Shards: 4},
	}})
	if err != nil {
		t.Fatal(err)
	}
	const (
		// A Limit on an unsharded limit is a statement that reads the clock first (txlimit_clock,
		// migration 00002), then updates txlimit_state; any other list of one calls
		// txlimit_decide_one_v1 (migration 00003).
		decideRow = "function txlimit_clock does not exist"
		decideOne = "function txlimit_decide_one_v1 does not exist"
		decide    = "function txlimit_decide_v1 does not exist"
		clock     = "function txlimit_clock does not exist"
		// State, Credit and Reset each call a function of their own (migration 00004).
		levels = "function txlimit_levels_v1 does not exist"
		credit = "function txlimit_credit_v1 does not exist"
		reset  = "function txlimit_reset_v1 does not exist"
	)
	calls := []struct {
		op   string
		call func(db ratelimit.Executor) error
		// missing and code are what Postgres did not find, as the message says it, and its SQLSTATE.
		missing, code string
	}{
		{"Limit", func(db ratelimit.Executor) error { _, err := lim.Limit(ctx, db, "a", "k", nil); return err }, decideRow, "42883"},
		{"Limit", func(db ratelimit.Executor) error { _, err := lim.Limit(ctx, db, "sharded", "k", nil); return err }, decideOne, "42883"},
		{"Check", func(db ratelimit.Executor) error { _, err := lim.Check(ctx, db, "a", "k", nil); return err }, decideOne, "42883"},
		{"LimitMany", func(db ratelimit.Executor) error {
			_, err := lim.LimitMany(ctx, db, []ratelimit.Request{{Name: "a", Key: "k"}, {Name: "a", Key: "j"}}, nil)
			return err
		}, decide, "42883"},
		{"Credit", func(db ratelimit.Executor) error { _, err := lim.Credit(ctx, db, "a", "k", 1, nil); return err }, credit, "42883"},
		{"State", func(db ratelimit.Executor) error { _, err := lim.State(ctx, db, "a", "k", nil); return err }, levels, "42883"},
		{"Reset", func(db ratelimit.Executor) error { return lim.Reset(ctx, db, "a", "k") }, reset, "42883"},
		{"Prune", func(db ratelimit.Executor) error { _, err := lim.Prune(ctx, db, "a", nil); return err }, clock, "42883"},
		{"CheckSchema", func(db ratelimit.Executor) error { return ratelimit.CheckSchema(ctx, db) }, `relation "txlimit_goose_version" does not exist`, "42P01"},
	}

	t.Run("forgotten migration", func(t *testing.T) {
		t.Parallel()
		schema := testdb.NewSchema(t)
		pool := testdb.PoolOn(t, schema)
		for _, c := range calls {
			requireSetupError(t, c.op, c.call(pool), c.op, schema, c.code, missingIn(c.op, c.missing, c.code, schema))
		}
		// Inside a transaction the failed statement aborts it: the search_path is unknown, the
		// message says how to find it, and the transaction is still the caller's to roll back.
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		err = calls[0].call(tx)
		requireSetupError(t, "in a transaction", err, "Limit", "", "42883",
			"ratelimit: Limit: run migrations.Up(ctx, pool) at start-up with this search_path (adding migrations.CreateSchema() if its schema does not exist yet), or set search_path to the schema it ran in: "+
				"function txlimit_clock does not exist in this connection's search_path (SQLSTATE 42883; "+
				"the transaction is aborted, so the search_path could not be read: run SHOW search_path on that connection; see docs/deploy.md)")
	})

	t.Run("search_path names another schema", func(t *testing.T) {
		t.Parallel()
		testdb.Pool(t, nil) // a migrated schema, which the next pool does not look in
		other := testdb.NewSchema(t)
		pool := testdb.PoolOn(t, other+", public")
		requireSetupError(t, "Limit", calls[0].call(pool), "Limit", other+", public", "42883", missingIn("Limit", decideRow, "42883", other+", public"))
		requireSetupError(t, "CheckSchema", ratelimit.CheckSchema(ctx, pool), "CheckSchema", other+", public", "42P01",
			missingIn("CheckSchema", `relation "txlimit_goose_version" does not exist`, "42P01", other+", public"))
	})

	t.Run("schema behind", func(t *testing.T) {
		t.Parallel()
		pool := testdb.Pool(t, nil)
		if err := ratelimit.CheckSchema(ctx, pool); err != nil {
			t.Fatalf("CheckSchema on a current schema: %v", err)
		}
		db := stdlib.OpenDBFromPool(pool)
		defer db.Close()
		p, err := migrations.NewProvider(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := p.Down(ctx); err != nil {
			t.Fatal(err)
		}
		v, err := p.GetDBVersion(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var schema string
		if err := pool.QueryRow(ctx, "SHOW search_path").Scan(&schema); err != nil {
			t.Fatal(err)
		}
		err = ratelimit.CheckSchema(ctx, pool)
		requireSetupError(t, "CheckSchema", err, "CheckSchema", schema, "", fmt.Sprintf(
			"ratelimit: CheckSchema: run migrations.Up(ctx, pool) at start-up with this search_path: search_path %q leads to a schema at migration version %d, "+
				"this build of txlimit needs %d (see docs/deploy.md)", schema, v, migrations.Latest()))
		var se *ratelimit.SetupError
		if errors.As(err, &se); se.Version != v || se.Want != migrations.Latest() || v >= se.Want {
			t.Errorf("CheckSchema: Version %d, Want %d; want %d, %d", se.Version, se.Want, v, migrations.Latest())
		}
		// The last migration's objects are gone: Reset needs them.
		var pgErr *pgconn.PgError
		err = lim.Reset(ctx, pool, "a", "k")
		if !errors.As(err, &pgErr) {
			t.Fatalf("Reset on a schema behind: %v; want a Postgres error", err)
		}
		requireSetupError(t, "Reset", err, "Reset", schema, "42883", missingIn("Reset", reset, "42883", schema))
	})

	// A newer txlimit's migration drops a function's old version a release after its new one
	// (CONTRIBUTING.md): a build two releases behind then finds its schema "ahead" yet without a
	// function it calls. CheckSchema says so at start-up, naming the function and the fix (a newer
	// build), not migrations.Up, which would change nothing.
	t.Run("schema ahead without a function this build calls", func(t *testing.T) {
		t.Parallel()
		pool := testdb.Pool(t, nil)
		if _, err := pool.Exec(ctx, fmt.Sprintf("INSERT INTO %s (version_id, is_applied) VALUES (%d, true); DROP FUNCTION txlimit_decide_one_v1",
			migrations.VersionTable, migrations.Latest()+1)); err != nil {
			t.Fatal(err)
		}
		var schema string
		if err := pool.QueryRow(ctx, "SHOW search_path").Scan(&schema); err != nil {
			t.Fatal(err)
		}
		err := ratelimit.CheckSchema(ctx, pool)
		want := fmt.Sprintf("ratelimit: CheckSchema: deploy a newer build of txlimit (the schema, at migration version %d, has no function "+
			"txlimit_decide_one_v1, which this build (version %d) calls: a newer txlimit migrated it and dropped what this build needs; "+
			"the connection's search_path is %q)", migrations.Latest()+1, migrations.Latest(), schema)
		var se *ratelimit.SetupError
		if !errors.As(err, &se) || !errors.Is(err, ratelimit.ErrSetup) || err.Error() != want {
			t.Fatalf("CheckSchema:\n got %v\nwant %s", err, want)
		}
	})

	// A function this build calls that has an overload (another function of the same name, say one
	// a later migration adds with other arguments) is still there: CheckSchema finds it by name
	// among the functions the search_path sees, as a call does by its arguments.
	t.Run("a function this build calls with an overload", func(t *testing.T) {
		t.Parallel()
		pool := testdb.Pool(t, nil)
		if _, err := pool.Exec(ctx, "CREATE FUNCTION txlimit_level(text) RETURNS double precision LANGUAGE sql AS 'SELECT 0::double precision'"); err != nil {
			t.Fatal(err)
		}
		if err := ratelimit.CheckSchema(ctx, pool); err != nil {
			t.Fatalf("CheckSchema: %v", err)
		}
	})

	// A schema at this build's own version without a function this build calls was not migrated by
	// a newer txlimit: another build's migrations made it (they change in place until the first
	// release), or the function was dropped. Neither a newer build nor migrations.Up (nothing to
	// do) restores it; re-applying the migrations after the table does, keeping every limit's state.
	t.Run("schema at this build's version without a function this build calls", func(t *testing.T) {
		t.Parallel()
		pool := testdb.Pool(t, nil)
		if _, err := pool.Exec(ctx, "DROP FUNCTION txlimit_decide_one_v1"); err != nil {
			t.Fatal(err)
		}
		var schema string
		if err := pool.QueryRow(ctx, "SHOW search_path").Scan(&schema); err != nil {
			t.Fatal(err)
		}
		problem := fmt.Sprintf("the schema, at this build's migration version %d, has no function txlimit_decide_one_v1, which this build calls: "+
			"another build's migrations made it (they change in place until txlimit's first release), or the function was dropped; "+
			"version 1 keeps txlimit_state; the connection's search_path is %q)", migrations.Latest(), schema)
		fix := "roll back to migration version 1 and run migrations.Up again"
		for _, c := range []struct {
			op   string
			err  error
			want string
		}{
			{"CheckSchema", ratelimit.CheckSchema(ctx, pool), "ratelimit: CheckSchema: " + fix + " (" + problem},
			{"Limit", calls[1].call(pool), "ratelimit: Limit: " + fix + " (" + problem + " (SQLSTATE 42883; see docs/deploy.md)"},
		} {
			var se *ratelimit.SetupError
			if !errors.As(c.err, &se) || !errors.Is(c.err, ratelimit.ErrSetup) || c.err.Error() != c.want || se.Fix != fix {
				t.Errorf("%s:\n got %v\nwant %s", c.op, c.err, c.want)
			}
		}
	})

	// The same schema at run time: a call that finds its function gone names the same fix as
	// CheckSchema, a newer build, rather than migrations.Up, which finds nothing to do there.
	t.Run("a call on a schema a newer txlimit migrated without a function it calls", func(t *testing.T) {
		t.Parallel()
		pool := testdb.Pool(t, nil)
		newer := migrations.Latest() + 1
		if _, err := pool.Exec(ctx, fmt.Sprintf("INSERT INTO %s (version_id, is_applied) VALUES (%d, true); DROP FUNCTION txlimit_decide_one_v1",
			migrations.VersionTable, newer)); err != nil {
			t.Fatal(err)
		}
		var schema string
		if err := pool.QueryRow(ctx, "SHOW search_path").Scan(&schema); err != nil {
			t.Fatal(err)
		}
		if err := migrations.Up(ctx, pool); err != nil {
			t.Fatalf("Up on a newer schema: %v", err)
		}
		err := calls[1].call(pool) // a sharded Limit: txlimit_decide_one_v1
		want := fmt.Sprintf("ratelimit: Limit: deploy a newer build of txlimit (the schema, at migration version %d, has no function "+
			"txlimit_decide_one_v1, which this build (version %d) calls: a newer txlimit migrated it and dropped what this build needs; "+
			"the connection's search_path is %q) (SQLSTATE 42883; see docs/deploy.md)", newer, migrations.Latest(), schema)
		var se *ratelimit.SetupError
		var pgErr *pgconn.PgError
		if !errors.As(err, &se) || !errors.Is(err, ratelimit.ErrSetup) || err.Error() != want || !errors.As(err, &pgErr) {
			t.Fatalf("Limit:\n got %v\nwant %s", err, want)
		}
		if se.Fix != "deploy a newer build of txlimit" || se.Version != newer || se.Want != migrations.Latest() || pgErr.Code != "42883" {
			t.Errorf("Limit: Fix %q, Version %d, Want %d, SQLSTATE %s; want a newer build, %d, %d, 42883", se.Fix, se.Version, se.Want, pgErr.Code, newer, migrations.Latest())
		}
	})

	t.Run("no set-up error on a migrated schema, and other database errors stay as they are", func(t *testing.T) {
		t.Parallel()
		pool := testdb.Pool(t, nil)
		for i, c := range calls {
			if err := c.call(pool); err != nil {
				t.Errorf("step %d %s: %v", i, c.op, err)
			}
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "SELECT 1/0"); err == nil {
			t.Fatal("1/0 succeeded")
		}
		err = calls[0].call(tx) // 25P02: the transaction is aborted, not a set-up mistake
		if err == nil || errors.Is(err, ratelimit.ErrSetup) || !strings.HasPrefix(err.Error(), "ratelimit: Limit: ") {
			t.Errorf("Limit in an aborted transaction: %v; want a plain database error", err)
		}
	})
}

// TestSchemaVersionListsEveryFunctionCalled: the list of functions CheckSchema looks for
// (SchemaVersion in internal/dbsqlc/queries/setup.sql) names every txlimit function the library's
// statements call, and nothing else.
func TestSchemaVersionListsEveryFunctionCalled(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("../internal/dbsqlc/queries/*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("no queries: %v", err)
	}
	call := regexp.MustCompile(`\btxlimit_[a-z0-9_]+\(`)
	list := regexp.MustCompile(`'\{(txlimit_[a-z0-9_,]+)\}'::text\[\]`)
	called := map[string]bool{}
	var listed []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(strings.TrimSpace(line), "--") {
				continue
			}
			for _, m := range call.FindAllString(line, -1) {
				called[strings.TrimSuffix(m, "(")] = true
			}
			if m := list.FindStringSubmatch(line); m != nil {
				listed = strings.Split(m[1], ",")
			}
		}
	}
	want := make([]string, 0, len(called))
	for name := range called {
		want = append(want, name)
	}
	sort.Strings(want)
	if !slices.Equal(listed, want) {
		t.Errorf("SchemaVersion looks for\n%v\nthe statements call\n%v", listed, want)
	}
}
