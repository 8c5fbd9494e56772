package testdb

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// RequireReadmeQuote fails tb unless the Go block of the README between the markers
// "<!-- marker:begin -->" and "<!-- marker:end -->" is a verbatim part of exampleFunc's body in
// exampleFile (of the whole file when exampleFunc is empty), so that a README snippet can never
// drift from the runnable example it quotes. Paths are relative to the test's package.
func RequireReadmeQuote(tb testing.TB, readme, marker, exampleFile, exampleFunc string) {
	tb.Helper()
	text, err := os.ReadFile(readme)
	if err != nil {
		tb.Fatal(err)
	}
	example, err := os.ReadFile(exampleFile)
	if err != nil {
		tb.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(text), "<!-- "+marker+":begin -->\n```go\n")
	quote, _, ok2 := strings.Cut(rest, "```\n<!-- "+marker+":end -->")
	if !ok || !ok2 || strings.TrimSpace(quote) == "" {
		tb.Fatalf("%s has no %s block between its markers", readme, marker)
	}
	body := string(example)
	if exampleFunc != "" {
		_, body, _ = strings.Cut(body, "func "+exampleFunc+"() {\n")
		body, _, _ = strings.Cut(body, "\n}\n")
	}
	if !strings.Contains(body, strings.TrimSuffix(quote, "\n")) {
		tb.Fatalf("%s's %s block is not a verbatim part of %s in %s; update the README from the example.\nREADME quote:\n%s",
			readme, marker, exampleFunc, exampleFile, quote)
	}
}

// PoolOn opens a pool of two connections whose search_path is schema (which need not exist or be
// migrated), closed when the test ends.
func PoolOn(tb testing.TB, schema string) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(DSN(tb))
	if err != nil {
		tb.Fatalf("testdb: parse DSN: %v", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatalf("testdb: connect: %v", err)
	}
	tb.Cleanup(pool.Close)
	return pool
}
