package testdb

import (
	"context"
	"testing"
)

// SearchPath returns the search_path of db's connection.
func SearchPath(tb testing.TB, db Querier) string {
	tb.Helper()
	var path string
	if err := db.QueryRow(context.Background(), "SELECT current_setting('search_path')").Scan(&path); err != nil {
		tb.Fatalf("testdb: search_path: %v", err)
	}
	return path
}
