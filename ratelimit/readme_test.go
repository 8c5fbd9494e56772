package ratelimit_test

import (
	"os"
	"strings"
	"testing"
)

// The README quotes Example_quickstart; this keeps the quote identical to the code that runs.
func TestReadmeQuotesTheQuickstartExample(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	example, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(readme), "<!-- quickstart:begin -->\n```go\n")
	quote, _, ok2 := strings.Cut(rest, "```\n<!-- quickstart:end -->")
	if !ok || !ok2 || strings.TrimSpace(quote) == "" {
		t.Fatal("README.md has no quickstart block between its markers")
	}
	_, body, _ := strings.Cut(string(example), "func Example_quickstart() {\n")
	body, _, _ = strings.Cut(body, "\n}\n")
	if !strings.Contains(body, strings.TrimSuffix(quote, "\n")) {
		t.Fatalf("README.md's quickstart is not a verbatim part of Example_quickstart; update the README from ratelimit/example_test.go.\nREADME quote:\n%s", quote)
	}
}
