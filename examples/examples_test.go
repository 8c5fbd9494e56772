// Package examples holds the runnable programs (demo, httpserver, llmbudget); this test keeps them
// copyable into an application.
package examples

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
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
