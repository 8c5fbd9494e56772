package testdb

import "testing"

// SearchPath returns the search_path of db's connection.
func SearchPath(tb testing.TB, db Querier) string {
	tb.Helper()
	return scalar[string](tb, db, "search_path", "SELECT current_setting('search_path')")
}
