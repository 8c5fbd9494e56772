package migrations_test

import (
	"io/fs"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/txlimit/txlimit/migrations"
)

// TestReadmeCountsTheMigrations keeps README.md's "There are N migrations" (section Migrations)
// equal to the migrations embedded in FS: it said three after a fourth, the operations, was added.
func TestReadmeCountsTheMigrations(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`There are (\w+)\s+migrations`).FindSubmatch(readme)
	if m == nil {
		t.Fatal(`README.md: no "There are N migrations"`)
	}
	names, err := fs.Glob(migrations.FS, "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	words := []string{"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"}
	if len(names) >= len(words) {
		t.Fatalf("%d migrations: extend the number words", len(names))
	}
	if got, want := strings.ToLower(string(m[1])), words[len(names)]; got != want {
		t.Fatalf("README.md says there are %s migrations; %d are embedded: %v", got, len(names), names)
	}
}
