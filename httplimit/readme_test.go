package httplimit_test

import (
	"os"
	"strings"
	"testing"
)

// The README quotes Example_middleware; this keeps the quote identical to the code that runs.
func TestReadmeQuotesTheMiddlewareExample(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	example, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(readme), "<!-- httplimit:begin -->\n```go\n")
	quote, _, ok2 := strings.Cut(rest, "```\n<!-- httplimit:end -->")
	if !ok || !ok2 || strings.TrimSpace(quote) == "" {
		t.Fatal("README.md has no httplimit block between its markers")
	}
	if !strings.Contains(string(example), quote) {
		t.Fatalf("README.md's HTTP snippet is not a verbatim part of Example_middleware; update it from httplimit/example_test.go.\nREADME quote:\n%s", quote)
	}
}
