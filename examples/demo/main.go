// Command demo walks through txlimit against a real Postgres: a per-user limit inside a
// transaction that also writes a business row, a rollback that gives the tokens back, a
// reservation with its retryAt, and two limits taken together. It prints what happened and exits 0.
//
// It connects to DATABASE_URL and migrates the first schema of its search_path, as an application
// does at start-up: make demo sets DATABASE_URL to a fresh schema, dropped at the end (by hand,
// name an empty one: …?search_path=demo). It imports only public packages, so it can be copied into
// an application.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/ratelimit"
)

func main() {
	if err := run(context.Background()); err != nil {
		log.Fatalf("demo: %v", err)
	}
}

func run(ctx context.Context) error {
	fmt.Println("# demo: limits decided inside the transactions that write")
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		return errors.New("DATABASE_URL is not set: set it to a Postgres URL, or run make demo, which finds or starts a Postgres")
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE messages (id bigserial PRIMARY KEY, user_id text NOT NULL, body text NOT NULL)"); err != nil {
		return fmt.Errorf("create the table messages: %w (DATABASE_URL must lead to an empty schema: set its search_path to a new one, or drop this one's tables)", err)
	}

	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"sendMessage":   {Rate: 3, Period: time.Minute},
		"llmTokens":     {Rate: 10_000, Period: time.Minute, MaxReserved: 20_000},
		"signupsPerIP":  {Rate: 2, Period: time.Hour},
		"signupsGlobal": {Kind: ratelimit.FixedWindow, Rate: 1000, Period: 24 * time.Hour},
	}})
	if err != nil {
		return err
	}

	fmt.Println("\n== a per-user limit inside the transaction that writes the message (3 per minute)")
	send := func(user, body string, fail bool) (ratelimit.Result, error) {
		var res ratelimit.Result
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var err error
			if res, err = limiter.Limit(ctx, tx, "sendMessage", user, &ratelimit.LimitOpts{AsError: true}); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, "INSERT INTO messages (user_id, body) VALUES ($1, $2)", user, body); err != nil {
				return err
			}
			if fail {
				return errors.New("the message failed a later check")
			}
			return nil
		})
		return res, err
	}
	for i := 1; i <= 4; i++ {
		res, err := send("alice", fmt.Sprintf("hello #%d", i), false)
		var limited *ratelimit.LimitedError
		switch {
		case errors.As(err, &limited):
			fmt.Printf("message %d: denied, nothing written; retry in %.1fs\n", i, limited.RetryAt.Sub(res.Time).Seconds())
		case err != nil:
			return err
		default:
			fmt.Printf("message %d: sent, %.2f tokens left\n", i, res.Value)
		}
	}
	count := func(user string) (n int) {
		_ = pool.QueryRow(ctx, "SELECT count(*) FROM messages WHERE user_id = $1", user).Scan(&n)
		return n
	}
	fmt.Printf("alice has %d messages stored\n", count("alice"))

	fmt.Println("\n== a rollback gives the token back")
	before, err := limiter.State(ctx, pool, "sendMessage", "bob", nil)
	if err != nil {
		return err
	}
	_, err = send("bob", "will be rolled back", true)
	fmt.Printf("bob's transaction: %v\n", err)
	after, err := limiter.State(ctx, pool, "sendMessage", "bob", nil)
	if err != nil {
		return err
	}
	fmt.Printf("bob's tokens before %.2f, after %.2f; messages stored: %d\n", before.Value, after.Value, count("bob"))

	fmt.Println("\n== reserving an LLM token budget (10,000 per minute, at most 20,000 owed)")
	for _, estimate := range []float64{6_000, 12_000, 15_000} {
		res, err := limiter.LimitN(ctx, pool, "llmTokens", "tenant-7", estimate, &ratelimit.LimitOpts{Reserve: true})
		if err != nil {
			return err
		}
		switch {
		case res.Reserved:
			fmt.Printf("%6.0f tokens: reserved; run at %s (in %.1fs); budget %.0f\n", estimate, res.RetryAt.Format(time.TimeOnly), res.RetryAfter().Seconds(), res.Value)
		case res.OK:
			fmt.Printf("%6.0f tokens: granted now; budget %.0f\n", estimate, res.Value)
		default:
			fmt.Printf("%6.0f tokens: refused, it would owe more than 20,000; retry in %.1fs\n", estimate, res.RetryAfter().Seconds())
		}
	}
	settled, err := limiter.Credit(ctx, pool, "llmTokens", "tenant-7", 4_000, nil)
	if err != nil {
		return err
	}
	fmt.Printf("the first call used 2,000 tokens, not 6,000: credited %.0f back; budget %.0f\n", settled.Credited, settled.Value)

	fmt.Println("\n== two limits together, all or nothing: sign-ups per IP (2/hour) and global (1000/day)")
	for i := 1; i <= 3; i++ {
		m, err := limiter.LimitMany(ctx, pool, []ratelimit.Request{
			{Name: "signupsPerIP", Key: "203.0.113.9"}, {Name: "signupsGlobal"},
		}, nil)
		if err != nil {
			return err
		}
		if m.OK {
			fmt.Printf("sign-up %d: allowed\n", i)
			continue
		}
		for _, d := range m.Denied() {
			fmt.Printf("sign-up %d: denied by %s; retry at %s; nothing consumed\n", i, d.Name, m.RetryAt.Format(time.TimeOnly))
		}
	}
	global, err := limiter.State(ctx, pool, "signupsGlobal", "", nil)
	if err != nil {
		return err
	}
	fmt.Printf("global sign-ups left today: %.0f of 1000\n", global.Value)
	fmt.Println("\ndone")
	return nil
}
