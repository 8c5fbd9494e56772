package devdb

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/internal/pgtemp"
)

// closedURL is a URL on which nothing answers: the local step fails with it.
const closedURL = "postgres://postgres@127.0.0.1:1/test?sslmode=disable"

// anyDB returns the URL of a database this machine has, found the way the tests find theirs.
func anyDB(t *testing.T) string {
	t.Helper()
	db, err := Find(context.Background(), EnvTestURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Stop() })
	return db.URL
}

// TestFindTakesTheFirstVariableSet: a variable that is set is used as it is, without a probe (the
// URL here answers nowhere), and an empty one counts as unset.
func TestFindTakesTheFirstVariableSet(t *testing.T) {
	t.Setenv("TXLIMIT_DEVDB_FIRST", "")
	t.Setenv("TXLIMIT_DEVDB_SECOND", closedURL)
	db, err := Find(context.Background(), "TXLIMIT_DEVDB_FIRST", "TXLIMIT_DEVDB_SECOND")
	if err != nil {
		t.Fatal(err)
	}
	if db.URL != closedURL || db.From != "TXLIMIT_DEVDB_SECOND" {
		t.Fatalf("got %q from %q; want %q from TXLIMIT_DEVDB_SECOND", db.URL, db.From, closedURL)
	}
	if got, want := db.String(), "the database of TXLIMIT_DEVDB_SECOND, 127.0.0.1:1/test"; got != want {
		t.Fatalf("String: got %q, want %q", got, want)
	}
	if err := db.Stop(); err != nil {
		t.Fatalf("Stop of a database Find did not start: %v", err)
	}
}

// TestFindProbesTheLocalURL: with no variable set, the URL of TXLIMIT_LOCAL_URL is used when it
// answers.
func TestFindProbesTheLocalURL(t *testing.T) {
	url := anyDB(t)
	t.Setenv("TXLIMIT_DEVDB_UNSET", "")
	t.Setenv(EnvLocalURL, url)
	db, err := Find(context.Background(), "TXLIMIT_DEVDB_UNSET")
	if err != nil {
		t.Fatal(err)
	}
	if db.URL != url || db.From != FromLocal {
		t.Fatalf("got %q from %q; want %q from %q", db.URL, db.From, url, FromLocal)
	}
	if want := "the Postgres answering on " + Describe(url); db.String() != want {
		t.Fatalf("String: got %q, want %q", db.String(), want)
	}
}

// noDocker skips the test on a machine where Find would start a container.
func noDocker(t *testing.T) {
	t.Helper()
	if dockerAnswers(context.Background()) == nil {
		t.Skip("a Docker daemon answers: Find would start a container")
	}
}

// TestFindStartsAPrivateCluster: with nothing set and nothing answering, Find starts a private
// cluster, and Stop stops and removes it.
func TestFindStartsAPrivateCluster(t *testing.T) {
	noDocker(t)
	if _, err := pgtemp.Bindir(); err != nil {
		t.Skip(err)
	}
	t.Setenv("TXLIMIT_DEVDB_UNSET", "")
	t.Setenv(EnvLocalURL, closedURL)
	ctx := context.Background()
	db, err := Find(ctx, "TXLIMIT_DEVDB_UNSET")
	if err != nil {
		t.Fatal(err)
	}
	if db.From != FromCluster {
		t.Fatalf("From: got %q, want %q", db.From, FromCluster)
	}
	if want := "nothing on 127.0.0.1:1/test: a private throwaway Postgres, "; !strings.HasPrefix(db.String(), want) {
		t.Fatalf("String: got %q, want it to start with %q", db.String(), want)
	}
	if err := ping(ctx, db.URL); err != nil {
		t.Fatal(err)
	}
	if err := db.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := ping(ctx, db.URL); err == nil {
		t.Fatal("the cluster still answers after Stop")
	}
}

// TestFindSaysWhatItTried: when nothing works, one error lists every step and the three ways,
// naming the first variable.
func TestFindSaysWhatItTried(t *testing.T) {
	noDocker(t)
	t.Setenv("TXLIMIT_DEVDB_A", "")
	t.Setenv("TXLIMIT_DEVDB_B", "")
	t.Setenv(EnvLocalURL, closedURL)
	t.Setenv(pgtemp.EnvDisable, "off")
	_, err := Find(context.Background(), "TXLIMIT_DEVDB_A", "TXLIMIT_DEVDB_B")
	if err == nil {
		t.Fatal("Find found a database with every step disabled")
	}
	for _, want := range []string{
		"no Postgres found. Tried, in order:\n",
		"\n  - TXLIMIT_DEVDB_A and TXLIMIT_DEVDB_B: not set\n",
		"\n  - " + closedURL + ": ",
		"\n  - testcontainers: no Docker daemon answers",
		"\n  - private cluster: disabled by TXLIMIT_PRIVATE_CLUSTER=off\n",
		"\n  1. set TXLIMIT_DEVDB_A to the postgres:// URL",
		"\n  2. run `docker compose up -d`",
		"\n  3. install the Postgres server",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q:\n%v", want, err)
		}
	}
}

// TestOpenSchema: a schema left by an interrupted run is replaced, the new one is migrated and
// is the pool's search_path, and closeAll drops it.
func TestOpenSchema(t *testing.T) {
	url := anyDB(t)
	ctx := context.Background()
	schema := SchemaName("txlimit_devdb_test_")
	if _, err := CreateSchema(ctx, url, schema); err != nil { // the leftover: never dropped by its own run
		t.Fatal(err)
	}
	if err := exec(ctx, url, "CREATE TABLE "+schema+".leftover (id int)"); err != nil {
		t.Fatal(err)
	}
	pool, closeAll, err := OpenSchema(ctx, url, schema, &SchemaOpts{Configure: func(cfg *pgxpool.Config) { cfg.MaxConns = 2 }})
	if err != nil {
		t.Fatal(err)
	}
	var path string
	var leftover, state bool
	err = pool.QueryRow(ctx, `SELECT current_setting('search_path'), to_regclass('leftover') IS NOT NULL,
		to_regclass('txlimit_state') IS NOT NULL`).Scan(&path, &leftover, &state)
	if err != nil {
		t.Fatal(err)
	}
	if path != schema || leftover || !state {
		t.Fatalf("search_path %q (want %q), leftover table %v (want false), txlimit_state %v (want true)", path, schema, leftover, state)
	}
	if got := pool.Config().MaxConns; got != 2 {
		t.Fatalf("MaxConns: got %d, want 2 (Configure)", got)
	}
	if err := closeAll(); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT to_regnamespace($1) IS NOT NULL", schema).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		t.Fatalf("schema %s still exists after closeAll", schema)
	}
}
