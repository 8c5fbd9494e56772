package httplimit_test

import (
	"testing"

	"github.com/txlimit/txlimit/internal/testdb"
)

// The README quotes Example_middleware; this keeps the quote identical to the code that runs.
func TestReadmeQuotesTheMiddlewareExample(t *testing.T) {
	testdb.RequireReadmeQuote(t, "../README.md", "httplimit", "example_test.go", "Example_middleware")
}
