package ratelimit_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// A per-request API limit decided on the pool, not in a transaction of the caller's: concurrent
// requests are decided together, one statement and one commit per batch.
func ExampleBatcher() {
	ctx := context.Background()
	pool, done := testdb.ForExample() // a *pgxpool.Pool on a migrated schema
	defer done()

	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"api": {Rate: 10, Period: time.Minute, Capacity: 3},
	}})
	if err != nil {
		panic(err)
	}
	batcher, err := ratelimit.NewBatcher(pool, limiter, nil) // nil: the default lanes and batch size
	if err != nil {
		panic(err)
	}
	defer batcher.Close()

	// In an HTTP middleware: one decision per request, for the request's API key.
	allow := func(ctx context.Context, apiKey string) bool {
		res, err := batcher.Limit(ctx, "api", apiKey, nil)
		if err != nil {
			return false // fail closed: no answer from the database is no permission
		}
		return res.OK
	}

	var allowed atomic.Int64
	var wg sync.WaitGroup
	for range 10 { // ten concurrent requests with the same key
		wg.Go(func() {
			if allow(ctx, "key-1") {
				allowed.Add(1)
			}
		})
	}
	wg.Wait()
	fmt.Printf("10 concurrent requests: %d allowed\n", allowed.Load())
	// Output:
	// 10 concurrent requests: 3 allowed
}

// The README quotes ExampleBatcher; this keeps the quote identical to the code that runs.
func TestReadmeQuotesTheBatcherExample(t *testing.T) {
	testdb.RequireReadmeQuote(t, "../README.md", "batcher", "batcher_example_test.go", "ExampleBatcher")
}
