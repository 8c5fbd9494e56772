// Package examples holds the runnable programs (demo, httpserver, llmbudget); its tests keep them
// copyable into an application, and their errors saying what to do.
package examples

import (
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
)

// TestExamplesImportOnlyPublicPackages: a program under examples/ imports no internal package of
// txlimit, so it can be copied into an application as it is (issue 31, item 8). Its tests may: they
// are not part of what is copied, and they get their database as every test of the module does.
func TestExamplesImportOnlyPublicPackages(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("*/*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"demo", "httpserver", "llmbudget"} {
		if !slices.Contains(files, filepath.Join(want, "main.go")) {
			t.Fatalf("found no %s/main.go among the example files %v", want, files)
		}
	}
	for _, file := range files {
		if strings.HasSuffix(file, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			if strings.HasPrefix(path, "github.com/txlimit/txlimit/") && strings.Contains(path+"/", "/internal/") {
				t.Errorf("%s imports %s: an application cannot import it", file, path)
			}
		}
	}
}

// TestRunAgainSaysToNameAnEmptySchema: demo and httpserver create their table messages in the
// schema DATABASE_URL leads to, which must be empty (their package docs). Run a second time on the
// same schema, each fails saying so and how to go on; before, the error was Postgres's alone
// (relation "messages" already exists), which names no fix.
func TestRunAgainSaysToNameAnEmptySchema(t *testing.T) {
	for _, c := range []struct {
		dir  string
		args []string
	}{{"demo", nil}, {"httpserver", []string{"-demo"}}} {
		t.Run(c.dir, func(t *testing.T) {
			bin := filepath.Join(t.TempDir(), c.dir)
			out, err := exec.Command("go", "build", "-o", bin, "./"+c.dir).CombinedOutput()
			require.NoError(t, err, "%s", out)
			env := append(os.Environ(), "DATABASE_URL="+testdb.SchemaURL(t, testdb.NewSchema(t)))
			run := func() ([]byte, error) {
				cmd := exec.Command(bin, c.args...)
				cmd.Env = env
				return cmd.CombinedOutput()
			}
			out, err = run()
			require.NoError(t, err, "the first run:\n%s", out)
			out, err = run()
			require.Error(t, err, "the second run:\n%s", out)
			require.Contains(t, string(out), `relation "messages" already exists`)
			require.Contains(t, string(out), "DATABASE_URL must lead to an empty schema")
		})
	}
}
