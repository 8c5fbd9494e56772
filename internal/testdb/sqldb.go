package testdb

import (
	"context"
	"database/sql"
	"net"
	"net/url"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib" // registers database/sql driver "pgx"
	_ "github.com/lib/pq"            // registers database/sql driver "postgres"

	"github.com/txlimit/txlimit/migrations"
)

// SQLDrivers are the database/sql drivers package sqldb's tests run with: "pgx" (pgx's stdlib) and
// "postgres" (lib/pq).
var SQLDrivers = []string{"pgx", "postgres"}

// SQLDB returns a database/sql handle opened with driver ("pgx" or "postgres") on a fresh schema
// with txlimit's migrations applied (unless migrate is false), and a pgx pool on the same schema.
// Both are closed and the schema dropped when the test ends.
func SQLDB(tb testing.TB, driver string, migrate bool) (*sql.DB, *pgxpool.Pool) {
	tb.Helper()
	schema := NewSchema(tb)
	url := SchemaURL(tb, schema)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		tb.Fatalf("testdb: connect: %v", err)
	}
	tb.Cleanup(pool.Close)
	if migrate {
		if err := migrations.Up(context.Background(), pool); err != nil {
			tb.Fatalf("testdb: migrate schema %s: %v", schema, err)
		}
	}
	var db *sql.DB
	switch driver {
	case "pgx":
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			tb.Fatalf("testdb: parse DSN: %v", err)
		}
		db = stdlib.OpenDB(*cfg)
	case "postgres":
		db, err = sql.Open("postgres", url)
		if err != nil {
			tb.Fatalf("testdb: open lib/pq: %v", err)
		}
	default:
		tb.Fatalf("testdb: unknown database/sql driver %q", driver)
	}
	db.SetMaxOpenConns(4)
	tb.Cleanup(func() { _ = db.Close() })
	if err := db.PingContext(context.Background()); err != nil {
		tb.Fatalf("testdb: ping with %s: %v", driver, err)
	}
	return db, pool
}

// SchemaURL returns a postgres:// URL of the test database whose connections use schema as their
// search_path, in a form both pgx and lib/pq read (lib/pq sends unknown parameters, search_path
// among them, as run-time parameters).
func SchemaURL(tb testing.TB, schema string) string {
	tb.Helper()
	cfg, err := pgx.ParseConfig(DSN(tb))
	if err != nil {
		tb.Fatalf("testdb: parse DSN: %v", err)
	}
	u := url.URL{Scheme: "postgres", Host: net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), Path: "/" + cfg.Database}
	if cfg.Password != "" {
		u.User = url.UserPassword(cfg.User, cfg.Password)
	} else {
		u.User = url.User(cfg.User)
	}
	q := url.Values{}
	q.Set("search_path", schema)
	if cfg.TLSConfig == nil {
		q.Set("sslmode", "disable")
	} else {
		q.Set("sslmode", "require")
	}
	u.RawQuery = q.Encode()
	return u.String()
}
