package cli_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/txlimit/txlimit/cli"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// An application embeds the command with its own limits, so that an operator lists, inspects,
// resets and prunes them under the definitions the application runs with.
func ExampleRun() {
	// In an application, the same map it gives ratelimit.LimiterConfig.Limits.
	limits := map[string]ratelimit.Config{
		"sendMessage": {Rate: 10, Period: time.Minute, Capacity: 3},
		"invite":      {Rate: 5, Period: 24 * time.Hour},
	}
	ctx := context.Background()
	pool, done := testdb.ForExample()
	defer done()
	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: limits})
	if err != nil {
		panic(err)
	}
	if _, err := limiter.LimitN(ctx, pool, "invite", "user-42", 5, nil); err != nil {
		panic(err)
	}

	// In an application: os.Exit(cli.Run(ctx, os.Args[1:], os.Stdout, os.Stderr, opts)) in its main,
	// with DATABASE_URL set. Here, the example's database and schema.
	cfg := pool.Config()
	db := []string{"--dsn", cfg.ConnString(), "--schema", cfg.ConnConfig.RuntimeParams["search_path"]}
	opts := &cli.Options{Limits: limits}
	code := cli.Run(ctx, append(db, "names"), os.Stdout, os.Stderr, opts)
	fmt.Println("exit", code)
	code = cli.Run(ctx, append(db, "reset", "invite", "user-42"), os.Stdout, os.Stderr, opts)
	fmt.Println("exit", code)
	code = cli.Run(ctx, append(db, "prune"), os.Stdout, os.Stderr, opts)
	fmt.Println("exit", code)
	code = cli.Run(ctx, append(db, "inspect", "nope", "k"), os.Stdout, os.Stdout, opts)
	fmt.Println("exit", code)
	// Output:
	// NAME         ROWS  CONFIG
	// invite          1  token bucket 5/24h0m0s
	// total           1
	// exit 0
	// reset invite "user-42": full again
	// exit 0
	// invite               0 rows deleted
	// sendMessage          0 rows deleted
	// total                0 rows deleted
	// exit 0
	// txlimit: give limit "nope" a config in --config FILE, or with --rate and --period (unknown limit; configured: invite, sendMessage)
	// exit 3
}
