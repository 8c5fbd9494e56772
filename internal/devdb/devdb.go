// Package devdb finds or starts the Postgres that txlimit's tests (internal/testdb), `make demo`
// (internal/cmd/withdb) and the benchmarks (bench/) run against, and opens throwaway schemas on it.
//
// Find looks, in this order, for:
//  1. the first of the caller's environment variables that is set (TEST_DATABASE_URL for the
//     tests; DATABASE_URL, then TEST_DATABASE_URL for withdb; BENCH_DATABASE_URL, then
//     TEST_DATABASE_URL for the bench), used as it is;
//  2. Postgres on localhost:5432 (user postgres, database test, no password), when it accepts a
//     connection (TXLIMIT_LOCAL_URL names another URL to probe instead: set it to a closed port,
//     e.g. postgres://postgres@127.0.0.1:1/test, to skip this step on a machine where it answers);
//  3. a Postgres container started with testcontainers, when a Docker daemon answers;
//  4. a private throwaway cluster (package internal/pgtemp), when the Postgres server is installed
//     (initdb and pg_ctl in $TXLIMIT_PG_BINDIR, else on $PATH, else under /usr/lib/postgresql/*/bin,
//     as pgtemp.Bindir looks): in a temporary directory on a
//     free loopback port, stopped and removed when the program ends however it ends
//     (TXLIMIT_PRIVATE_CLUSTER=off skips this step);
//
// and otherwise returns one error that says what was tried and names the three ways to provide a
// database.
package devdb

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"

	"github.com/txlimit/txlimit/internal/pgtemp"
)

// EnvTestURL, TEST_DATABASE_URL, is the environment variable that names the tests' database, and
// the one Find reads when it is given none. Unset by default: then Find looks further.
const EnvTestURL = "TEST_DATABASE_URL"

// LocalURL is the database Find probes when none of its environment variables is set: the one
// docker-compose.yml starts. It is the default of EnvLocalURL.
const LocalURL = "postgres://postgres@localhost:5432/test?sslmode=disable"

// EnvLocalURL names a URL Find probes instead of LocalURL. Set it to a closed port to make Find
// start a database on a machine where LocalURL answers. Defaults to unset: LocalURL is probed.
const EnvLocalURL = "TXLIMIT_LOCAL_URL"

// The places Find takes a database from, besides an environment variable (DB.From).
const (
	// FromLocal is DB.From for the database answering on LocalURL or $TXLIMIT_LOCAL_URL.
	FromLocal = "localhost"
	// FromContainer is DB.From for a Postgres container started with testcontainers.
	FromContainer = "testcontainers"
	// FromCluster is DB.From for a private throwaway cluster (package internal/pgtemp).
	FromCluster = "private cluster"
)

// probeWait bounds a probe: a connection to the local URL, or a call to the Docker daemon.
const probeWait = 5 * time.Second

// DB is a Postgres that Find found or started.
type DB struct {
	// URL connects to it, as a superuser or a role that may create schemas. Never empty.
	URL string
	// From says where it came from: the name of the environment variable that was set, or
	// FromLocal, FromContainer or FromCluster. Never empty.
	From string

	local string       // the local URL that did not answer, when Find went past it
	stop  func() error // stops what Find started; nil for a database it found
}

// Find returns the first database it finds or starts, in the order of the package doc, reading
// the environment variables envVars in that order first. With no envVars it reads EnvTestURL
// (TEST_DATABASE_URL) alone. The first of envVars is the one the error names as a way to provide a
// database. ctx bounds the search; starting a database takes at most pgtemp.Wait besides.
func Find(ctx context.Context, envVars ...string) (*DB, error) {
	if len(envVars) == 0 {
		envVars = []string{EnvTestURL}
	}
	for _, env := range envVars {
		if u := os.Getenv(env); u != "" {
			return &DB{URL: u, From: env}, nil
		}
	}
	local := LocalURL
	if u := os.Getenv(EnvLocalURL); u != "" {
		local = u
	}
	localErr := ping(ctx, local)
	if localErr == nil {
		return &DB{URL: local, From: FromLocal}, nil
	}
	ctx, cancel := context.WithTimeout(ctx, pgtemp.Wait)
	defer cancel()
	dockerErr := dockerAnswers(ctx)
	if dockerErr == nil {
		db, err := startContainer(ctx)
		if err == nil {
			db.local = local
			return db, nil
		}
		dockerErr = err
	}
	c, clusterErr := pgtemp.Start(ctx)
	if clusterErr == nil {
		// The caller may Stop it; otherwise the cluster's watchdog stops and removes it when this
		// program ends.
		return &DB{URL: c.URL, From: FromCluster, local: local, stop: c.Stop}, nil
	}
	return nil, fmt.Errorf("no Postgres found. Tried, in order:\n"+
		"  - %s: not set\n  - %s: %v\n  - testcontainers: %v\n  - %v\n%s",
		strings.Join(envVars, " and "), local, localErr, dockerErr, clusterErr, ways(envVars[0]))
}

// Stop stops and removes the database when Find started it (a container or a private cluster),
// and returns when that is done; it does nothing to a database Find found. Calling it is optional:
// a started database is removed when the program ends in any case.
func (db *DB) Stop() error {
	if db.stop == nil {
		return nil
	}
	stop := db.stop
	db.stop = nil
	return stop()
}

// String says where the database came from and which it is, by host, port and database name
// (never a user or password): "the database of TEST_DATABASE_URL, db.example:5432/app", "the
// Postgres answering on localhost:5432/test", "nothing on localhost:5432/test: a private throwaway
// Postgres, 127.0.0.1:40123/postgres".
func (db *DB) String() string {
	switch db.From {
	case FromLocal:
		return "the Postgres answering on " + Describe(db.URL)
	case FromContainer:
		return "nothing on " + Describe(db.local) + ": a Postgres container started with testcontainers, " + Describe(db.URL)
	case FromCluster:
		return "nothing on " + Describe(db.local) + ": a private throwaway Postgres, " + Describe(db.URL)
	}
	return "the database of " + db.From + ", " + Describe(db.URL)
}

// Describe names the database of url by host, port and database name, without user or password:
// "localhost:5432/test". It says "an unparsable URL" when pgx cannot read url.
func Describe(url string) string {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return "an unparsable URL"
	}
	return fmt.Sprintf("%s:%d/%s", cfg.Host, cfg.Port, cfg.Database)
}

// ping connects to url and pings it, within probeWait.
func ping(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, probeWait)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx)
}

// dockerAnswers says whether a Docker daemon answers within probeWait.
func dockerAnswers(ctx context.Context) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("docker client panicked: %v", r)
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, probeWait)
	defer cancel()
	cli, err := testcontainers.NewDockerClientWithOpts(ctx)
	if err != nil {
		return fmt.Errorf("no Docker daemon answers: %w", err)
	}
	defer cli.Close()
	return nil
}

// startContainer starts a Postgres container. It lives until DB.Stop or until this program ends:
// testcontainers' reaper removes it then.
func startContainer(ctx context.Context) (*DB, error) {
	c, err := tcpostgres.Run(ctx, "postgres:15-alpine",
		tcpostgres.WithDatabase("test"),
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies(),
	)
	if err != nil {
		return nil, fmt.Errorf("starting a Postgres container: %w", err)
	}
	url, err := c.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		_ = c.Terminate(context.Background())
		return nil, err
	}
	return &DB{URL: url, From: FromContainer, stop: func() error { return c.Terminate(context.Background()) }}, nil
}

// ways is the closing part of Find's error: the three ways to provide a database. envURL is the
// variable the program reads first.
func ways(envURL string) string {
	return "Any one of these three makes it work:\n" +
		"  1. set " + envURL + " to the postgres:// URL of a database where schemas may be created;\n" +
		"  2. run `docker compose up -d` in the repository (a Postgres on localhost:5432, user postgres, database test);\n" +
		"  3. install the Postgres server (Debian/Ubuntu: apt-get install postgresql; macOS: brew install postgresql):\n" +
		"     with initdb and pg_ctl on $PATH or under /usr/lib/postgresql/*/bin, a private throwaway cluster is started and removed afterwards."
}
