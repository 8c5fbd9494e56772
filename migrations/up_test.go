package migrations_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/migrations"
)

// TestLatestIsTheLastEmbeddedMigration pins Latest to what goose itself reads from FS.
func TestLatestIsTheLastEmbeddedMigration(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, nil)
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	p, err := migrations.NewProvider(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	sources := p.ListSources()
	if got, want := migrations.Latest(), sources[len(sources)-1].Version; got != want {
		t.Fatalf("Latest() = %d; want %d, the last embedded migration", got, want)
	}
	if v, err := p.GetDBVersion(context.Background()); err != nil || v != migrations.Latest() {
		t.Fatalf("after Up: version %d, %v; want %d", v, err, migrations.Latest())
	}
}

// TestConcurrentMigratorsAreKeptApart runs Up from eight pools at once on one empty schema: every
// call succeeds and each migration ran exactly once (one version row each; goose would also fail a
// second run of a CREATE TABLE).
func TestConcurrentMigratorsAreKeptApart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testdb.NewSchema(t)
	const n = 8
	pools := make([]*pgxpool.Pool, n)
	for i := range pools {
		pools[i] = testdb.PoolOn(t, schema)
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range pools {
		wg.Go(func() { errs[i] = migrations.Up(ctx, pools[i]) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("migrator %d: %v", i, err)
		}
	}
	var applied, locked int
	if err := pools[0].QueryRow(ctx, "SELECT count(*) FROM "+migrations.VersionTable+" WHERE version_id > 0").Scan(&applied); err != nil {
		t.Fatal(err)
	}
	if err := pools[0].QueryRow(ctx, "SELECT count(*) FROM "+migrations.LockTable+" WHERE locked").Scan(&locked); err != nil {
		t.Fatal(err)
	}
	if int64(applied) != migrations.Latest() || locked != 0 {
		t.Fatalf("after %d concurrent Ups: %d versions applied, %d locks held; want %d, 0",
			n, applied, locked, migrations.Latest())
	}
}

// TestUpWaitsForTheLockHolder holds the schema's migration lock the way another migrator would
// (goose's table locker on the same row): Up does not finish while it is held, and finishes once it
// is released.
func TestUpWaitsForTheLockHolder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testdb.NewSchema(t)
	_, release := testdb.HoldMigrationLock(t, testdb.PoolOn(t, schema), schema)
	done := make(chan error, 1)
	go func() { done <- migrations.Up(ctx, testdb.PoolOn(t, schema)) }()
	select {
	case err := <-done:
		t.Fatalf("Up finished while another migrator held the lock: %v", err)
	case <-time.After(2 * time.Second):
	}
	release()
	if err := <-done; err != nil {
		t.Fatalf("Up after the lock was released: %v", err)
	}
}

// TestUpCreateSchema: a search_path naming a schema that does not exist makes Up fail with a
// message naming the schema and the option, and with CreateSchema Up creates it and migrates it.
func TestUpCreateSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testdb.NewSchema(t) + "_Created" // mixed case: quoted in the search_path
	admin := testdb.Conn(t, testdb.PoolOn(t, "public"))
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	})
	pool := testdb.PoolOn(t, pgx.Identifier{schema}.Sanitize()+", public")
	err := migrations.Up(ctx, pool)
	if err == nil || !strings.Contains(err.Error(), schema) || !strings.Contains(err.Error(), "CreateSchema()") {
		t.Fatalf("Up on a missing schema: %v; want an error naming %q and CreateSchema()", err, schema)
	}
	if err := migrations.Up(ctx, pool, migrations.CreateSchema()); err != nil {
		t.Fatalf("Up with CreateSchema: %v", err)
	}
	var where string
	if err := pool.QueryRow(ctx, "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = 'txlimit_state'::regclass").Scan(&where); err != nil {
		t.Fatal(err)
	}
	if where != schema {
		t.Fatalf("txlimit_state is in schema %q; want %q", where, schema)
	}
	if err := migrations.Up(ctx, pool, migrations.CreateSchema()); err != nil {
		t.Fatalf("Up with CreateSchema a second time: %v", err)
	}
}

// TestUpRefusesToHideTheState: when the schema Up would migrate comes in the search_path before a
// schema that holds txlimit_state (a schema named after the role, created after migrating into
// public, say), a new table there would hide the limits' state and every key would start full
// again. Up refuses, names both schemas, and creates nothing; with the new schema alone in the
// search_path it migrates it, and then migrates again with the old one behind it.
func TestUpRefusesToHideTheState(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	old, front := testdb.NewSchema(t), testdb.NewSchema(t)
	if err := migrations.Up(ctx, testdb.PoolOn(t, old)); err != nil {
		t.Fatal(err)
	}
	both := testdb.PoolOn(t, front+", "+old)
	err := migrations.Up(ctx, both)
	if err == nil || !strings.Contains(err.Error(), `"`+old+`"`) || !strings.Contains(err.Error(), `"`+front+`"`) {
		t.Fatalf("Up in front of a migrated schema: %v; want an error naming %q and %q", err, front, old)
	}
	var created bool
	if err := both.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = $1)", front).Scan(&created); err != nil {
		t.Fatal(err)
	}
	if created {
		t.Fatalf("Up refused but created tables in %q", front)
	}
	if err := migrations.Up(ctx, testdb.PoolOn(t, front)); err != nil {
		t.Fatalf("Up with the new schema alone in the search_path: %v", err)
	}
	if err := migrations.Up(ctx, both); err != nil {
		t.Fatalf("Up again, the new schema migrated: %v", err)
	}
}

// TestUpRefusesAnEmptySearchPath: nothing to migrate into is an error, not a migration into
// whatever schema happens to come next.
func TestUpRefusesAnEmptySearchPath(t *testing.T) {
	t.Parallel()
	err := migrations.Up(context.Background(), testdb.PoolOn(t, ""), migrations.CreateSchema())
	if err == nil || !strings.Contains(err.Error(), "names no schema") {
		t.Fatalf("Up with an empty search_path: %v; want an error saying it names no schema", err)
	}
}

// TestUpOnAOneConnectionPool: Up needs a single connection (the lock is not taken by goose, which
// would hold one connection while its locker waits for a second).
func TestUpOnAOneConnectionPool(t *testing.T) {
	t.Parallel()
	schema := testdb.NewSchema(t)
	pool := testdb.PoolOn(t, schema)
	pool.Reset()
	cfg := pool.Config()
	cfg.MaxConns = 1
	one, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := migrations.Up(ctx, one); err != nil {
		t.Fatalf("Up on a pool of one connection: %v", err)
	}
}

// TestConcurrentMigratorsUnderSerializableDefault: with default_transaction_isolation SERIALIZABLE
// (set on a role or database), a migrator waiting for the lock loses serialization races on the
// lock row (40001) whenever its holder touches it; those are retried like a held lock, so every Up
// succeeds (before, most rounds failed one at once).
func TestConcurrentMigratorsUnderSerializableDefault(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for round := range 3 {
		schema := testdb.NewSchema(t)
		const n = 8
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			cfg, err := pgxpool.ParseConfig(testdb.DSN(t))
			if err != nil {
				t.Fatal(err)
			}
			cfg.ConnConfig.RuntimeParams["search_path"] = schema
			cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			wg.Go(func() { errs[i] = migrations.Up(ctx, pool) })
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Errorf("round %d, migrator %d: %v", round, i, err)
			}
		}
	}
}

// TestUpRefusesASchemaItCannotUse: a first schema of the search_path that the role may not use is
// skipped by Postgres (current_schema() is the next one); Up says so instead of migrating the
// later schema.
func TestUpRefusesASchemaItCannotUse(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	first, later := testdb.NewSchema(t), testdb.NewSchema(t)
	admin := testdb.PoolOn(t, "public")
	role := first + "_role"
	for _, q := range []string{
		"CREATE ROLE " + role + " LOGIN",
		"GRANT USAGE, CREATE ON SCHEMA " + later + " TO " + role,
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = admin.Exec(context.Background(), "DROP ROLE "+role)
	})
	cfg, err := pgxpool.ParseConfig(testdb.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User = role
	cfg.ConnConfig.RuntimeParams["search_path"] = first + ", " + later
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	err = migrations.Up(ctx, pool)
	if err == nil || !strings.Contains(err.Error(), "is not the one Postgres uses") || !strings.Contains(err.Error(), first) {
		t.Fatalf("Up with a first schema the role cannot use: %v; want an error naming %q", err, first)
	}
	var n int
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE schemaname = $1", later).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("Up created %d tables in the later schema %q", n, later)
	}
}

// TestUpDoesNotRetryReleasingALockItLost: a migrator whose lock row was taken from it while it ran
// (deleted by an operator, or stolen once its lease expired) reports that at once, rather than
// retrying the release for a minute, which no context cancels.
func TestUpDoesNotRetryReleasingALockItLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, nil)
	p := provider(t, pool)
	if _, err := p.DownTo(ctx, 0); err != nil {
		t.Fatal(err)
	}
	// Up takes the lock, then waits for the version table, until the lock row is gone.
	blocker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Rollback(ctx)
	if _, err := blocker.Exec(ctx, "LOCK TABLE "+migrations.VersionTable+" IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- migrations.Up(ctx, pool) }()
	for locked := 0; locked == 0; time.Sleep(10 * time.Millisecond) {
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+migrations.LockTable+" WHERE locked").Scan(&locked); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, "DELETE FROM "+migrations.LockTable); err != nil {
		t.Fatal(err)
	}
	if err := blocker.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "release the migration lock") || !strings.Contains(err.Error(), "not held by this instance") {
			t.Fatalf("Up after its lock row was deleted: %v; want an error saying the lock was not held", err)
		}
	case <-time.After(20 * time.Second):
		<-done
		t.Fatal("Up kept retrying the release of a lock it no longer held")
	}
	if v, err := p.GetDBVersion(ctx); err != nil || v != migrations.Latest() {
		t.Fatalf("after Up: version %d, %v; want %d", v, err, migrations.Latest())
	}
}
