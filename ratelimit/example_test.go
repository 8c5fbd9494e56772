package ratelimit_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// A per-user limit decided inside the transaction that does the work: the message and the token
// it costs commit together, or neither does.
func Example_quickstart() {
	ctx := context.Background()
	// In an application: pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL")), then
	// migrations.Up(ctx, pool) once at start-up. The examples get a fresh migrated schema.
	pool, done := testdb.ForExample()
	defer done()
	if _, err := pool.Exec(ctx, "CREATE TABLE messages (user_id text, body text)"); err != nil {
		panic(err)
	}

	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"sendMessage": {Rate: 10, Period: time.Minute, Capacity: 3},
	}})
	if err != nil {
		panic(err)
	}

	send := func(userID, body string) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			res, err := limiter.Limit(ctx, tx, "sendMessage", userID, nil)
			if err != nil {
				return err
			}
			if !res.OK {
				// Rounded up: never tell the user to come back too soon.
				return fmt.Errorf("slow down: retry in %.0fs", math.Ceil(res.RetryAfter().Seconds()))
			}
			_, err = tx.Exec(ctx, "INSERT INTO messages (user_id, body) VALUES ($1, $2)", userID, body)
			return err
		})
	}
	for i := 1; i <= 4; i++ {
		fmt.Printf("message %d: %v\n", i, send("user-42", "hello"))
	}
	// Output:
	// message 1: <nil>
	// message 2: <nil>
	// message 3: <nil>
	// message 4: slow down: retry in 6s
}

// Reserving an LLM token budget: a request larger than what is left books the tokens and learns
// when to run; the next request is refused once MaxReserved would be exceeded.
func ExampleLimiter_LimitN_reserve() {
	ctx := context.Background()
	start := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	pool, limiter, done := exampleLimiter(&ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{
			"llmTokens": {Rate: 40_000, Period: time.Minute, MaxReserved: 60_000},
		},
		Now: func() time.Time { return start }, // a fixed clock, so the output is exact
	})
	defer done()
	for _, estimate := range []float64{30_000, 50_000, 30_000} {
		res, err := limiter.LimitN(ctx, pool, "llmTokens", "tenant-7", estimate, &ratelimit.LimitOpts{Reserve: true})
		if err != nil {
			panic(err)
		}
		switch {
		case res.Reserved:
			fmt.Printf("%.0f tokens reserved: run in %v (budget %.0f)\n", estimate, res.RetryAfter(), res.Value)
		case res.OK:
			fmt.Printf("%.0f tokens granted: run now (budget %.0f)\n", estimate, res.Value)
		default:
			fmt.Printf("%.0f tokens refused: too much reserved, retry in %v\n", estimate, res.RetryAfter())
		}
	}
	// Output:
	// 30000 tokens granted: run now (budget 10000)
	// 50000 tokens reserved: run in 1m0s (budget -40000)
	// 30000 tokens refused: too much reserved, retry in 15s
}

// Several limits at once, all or nothing: a sign-up is limited per IP and globally. When the
// per-IP limit is exhausted nothing is consumed from the global one.
func ExampleLimiter_LimitMany() {
	ctx := context.Background()
	pool, limiter, done := exampleLimiter(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"signupsPerIP":  {Rate: 2, Period: time.Hour},
		"signupsGlobal": {Rate: 100, Period: time.Hour},
	}})
	defer done()
	for i := 1; i <= 3; i++ {
		m, err := limiter.LimitMany(ctx, pool, []ratelimit.Request{
			{Name: "signupsPerIP", Key: "203.0.113.9"},
			{Name: "signupsGlobal"},
		}, nil)
		if err != nil {
			panic(err)
		}
		fmt.Printf("sign-up %d: ok=%v denied=%d\n", i, m.OK, len(m.Denied()))
	}
	st, err := limiter.State(ctx, pool, "signupsGlobal", "", nil)
	if err != nil {
		panic(err)
	}
	fmt.Printf("global sign-ups left: %.0f\n", st.Value)
	// Output:
	// sign-up 1: ok=true denied=0
	// sign-up 2: ok=true denied=0
	// sign-up 3: ok=false denied=1
	// global sign-ups left: 98
}

// AsError turns a denial into an error, so a transaction can simply return it and roll back.
func ExampleLimitOpts_asError() {
	ctx := context.Background()
	pool, limiter, done := exampleLimiter(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"failedLogins": {Rate: 5, Period: time.Hour},
	}})
	defer done()
	err := ratelimit.InSerializableTx(ctx, pool, nil, func(ctx context.Context, tx pgx.Tx) error {
		_, err := limiter.LimitN(ctx, tx, "failedLogins", "alice", 6, &ratelimit.LimitOpts{AsError: true})
		return err
	})
	fmt.Println(errors.Is(err, ratelimit.ErrInvalid), err)

	for i := 0; i < 6; i++ {
		err = ratelimit.InSerializableTx(ctx, pool, nil, func(ctx context.Context, tx pgx.Tx) error {
			_, err := limiter.Limit(ctx, tx, "failedLogins", "alice", &ratelimit.LimitOpts{AsError: true})
			return err
		})
	}
	var limited *ratelimit.LimitedError
	fmt.Println(errors.As(err, &limited), limited.Name, limited.Key)
	// Output:
	// true ratelimit: LimitN: count 6 exceeds the capacity (5) of limit "failedLogins", so it could never be granted
	// true failedLogins alice
}

// exampleLimiter is how the examples after the quickstart begin: a pool on a fresh migrated schema
// (an application passes its own, migrated at start-up: see Example_quickstart), the limiter of
// cfg, and a function that closes the pool. It panics where an application would handle the error.
func exampleLimiter(cfg *ratelimit.LimiterConfig) (*pgxpool.Pool, *ratelimit.Limiter, func()) {
	pool, done := testdb.ForExample()
	limiter, err := ratelimit.New(cfg)
	if err != nil {
		done()
		panic(err)
	}
	return pool, limiter, done
}
