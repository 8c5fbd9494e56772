package testdb

import (
	"context"
	"database/sql"
	"fmt"
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

// SQLDrivers are the database/sql drivers the adapter tests run with: "pgx" (pgx's stdlib) and
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

// Echo sends v as parameter $1 cast to pgType (one of the types listed in echoTypes) and scans the
// result into dst: the round trip of one value through a driver.
func Echo(ctx context.Context, db Querier, pgType string, v, dst any) error {
	q, ok := echoQueries[pgType]
	if !ok {
		return fmt.Errorf("testdb: Echo: no query for type %q", pgType)
	}
	return db.QueryRow(ctx, q, v).Scan(dst)
}

var echoQueries = map[string]string{
	"text[]":        "SELECT $1::text[]",
	"float8[]":      "SELECT $1::float8[]",
	"bigint[]":      "SELECT $1::bigint[]",
	"integer[]":     "SELECT $1::integer[]",
	"smallint[]":    "SELECT $1::smallint[]",
	"boolean[]":     "SELECT $1::boolean[]",
	"timestamptz":   "SELECT $1::timestamptz",
	"timestamptz[]": "SELECT $1::timestamptz[]",
	"float8":        "SELECT $1::float8",
	"text":          "SELECT $1::text",
}

// NoRows runs a query that returns no row and scans it into dst.
func NoRows(ctx context.Context, db Querier, dst any) error {
	return db.QueryRow(ctx, "SELECT 1 WHERE false").Scan(dst)
}
