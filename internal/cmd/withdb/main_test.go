package main

import "testing"

// TestWithSearchPath: the schema reaches the server through options, in both forms of connection
// string, next to options already there, in a URL libpq reads too (a space is %20, not "+").
func TestWithSearchPath(t *testing.T) {
	t.Parallel()
	for i, tc := range []struct{ dsn, want string }{
		{"postgres://postgres@localhost:5432/test?sslmode=disable",
			"postgres://postgres@localhost:5432/test?options=-csearch_path%3Ds1&sslmode=disable"},
		{"postgresql://u:p@h/db?options=-cstatement_timeout%3D5s",
			"postgresql://u:p@h/db?options=-cstatement_timeout%3D5s%20-csearch_path%3Ds1"},
		{"host=h user=u dbname=db", "host=h user=u dbname=db options=-csearch_path=s1"},
		// The URL's own search_path (as the README suggests) would be sent after options and win.
		{"postgres://postgres@localhost:5432/test?sslmode=disable&search_path=app",
			"postgres://postgres@localhost:5432/test?options=-csearch_path%3Ds1&sslmode=disable"},
	} {
		got, err := withSearchPath(tc.dsn, "s1")
		if err != nil || got != tc.want {
			t.Errorf("step %d: got %q, %v; want %q", i, got, err, tc.want)
		}
	}
	if _, err := withSearchPath("postgres://h:port:x/db", "s1"); err == nil {
		t.Error("an unparsable URL: got no error")
	}
	if _, err := withSearchPath("host=h dbname=db search_path=app", "s1"); err == nil {
		t.Error("a key=value string setting search_path: got no error")
	}
}
