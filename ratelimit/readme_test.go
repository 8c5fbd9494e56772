package ratelimit_test

import (
	"testing"

	"github.com/txlimit/txlimit/internal/testdb"
)

// The README quotes Example_quickstart; this keeps the quote identical to the code that runs.
func TestReadmeQuotesTheQuickstartExample(t *testing.T) {
	testdb.RequireReadmeQuote(t, "../README.md", "quickstart", "example_test.go", "Example_quickstart")
}
