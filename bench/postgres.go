package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The naive Postgres contender keeps a token bucket in a table of its own and decides in Go:
// SELECT the row, compute, UPSERT, all in one SERIALIZABLE transaction retried on 40001/40P01.
// The clock is the database's, as for txlimit.
const (
	naiveCreateTable = `CREATE TABLE IF NOT EXISTS naive_bucket (
    name   text             NOT NULL,
    key    text             NOT NULL,
    tokens double precision NOT NULL,
    ts     timestamptz      NOT NULL,
    PRIMARY KEY (name, key)
)`

	naiveRead = `SELECT b.tokens, b.ts, c.now
FROM (SELECT clock_timestamp() AS now) c
LEFT JOIN naive_bucket b ON b.name = $1 AND b.key = $2`

	naiveUpsert = `INSERT INTO naive_bucket (name, key, tokens, ts) VALUES ($1, $2, $3, $4)
ON CONFLICT (name, key) DO UPDATE SET tokens = excluded.tokens, ts = excluded.ts`
)

// naiveMaxAttempts bounds the retries of one decision; then the decision is an error.
const naiveMaxAttempts = 20

// naive decides as an application would without txlimit: it reads the bucket, decides in Go and
// writes it back, in one transaction at iso, retried on 40001/40P01.
type naive struct {
	env *Env
	iso pgx.TxIsoLevel
}

func (c *naive) Decide(ctx context.Context, limit, key string) (Decision, error) {
	l, err := c.env.limitByName(limit)
	if err != nil {
		return Decision{}, err
	}
	backoff := time.Millisecond
	for attempt := 1; ; attempt++ {
		if attempt > 1 && Stopped(ctx) {
			return Decision{Retries: attempt - 1}, ErrStopped
		}
		d, err := c.once(ctx, l, key)
		d.Retries = attempt - 1
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || (pgErr.Code != "40001" && pgErr.Code != "40P01") {
			return d, err
		}
		if attempt == naiveMaxAttempts {
			return d, fmt.Errorf("naive: gave up after %d attempts: %w", attempt, err)
		}
		select {
		case <-ctx.Done():
			return d, ctx.Err()
		case <-time.After(rand.N(backoff + 1)):
		}
		backoff = min(2*backoff, 50*time.Millisecond)
	}
}

func (c *naive) once(ctx context.Context, l Limit, key string) (Decision, error) {
	tx, err := c.env.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: c.iso})
	if err != nil {
		return Decision{}, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var (
		tokens *float64
		ts     *time.Time
		now    time.Time
	)
	if err := tx.QueryRow(ctx, naiveRead, l.Name, key).Scan(&tokens, &ts, &now); err != nil {
		return Decision{}, err
	}
	level, at := l.Burst, now
	if tokens != nil {
		level, at = *tokens, *ts
		if now.After(at) {
			level = math.Min(l.Burst, level+now.Sub(at).Seconds()*l.PerSecond())
			at = now
		}
	}
	d := Decision{Allowed: level >= 1, At: now}
	if d.Allowed {
		if _, err := tx.Exec(ctx, naiveUpsert, l.Name, key, level-1, at); err != nil {
			return Decision{}, err
		}
	}
	return d, tx.Commit(ctx)
}

func (c *naive) Close() {}

// The floor is not a limiter: one autocommit UPDATE of one existing row per (limit, key), the least
// a durable decision made in one statement on the pool can cost (a round trip, a row lock, a WAL
// record and a commit). It grants everything; it runs in the throughput cells only.
const (
	floorCreateTable = `CREATE TABLE IF NOT EXISTS floor_counter (
    name  text   NOT NULL,
    key   text   NOT NULL,
    value bigint NOT NULL,
    PRIMARY KEY (name, key)
) WITH (fillfactor = 70)`

	floorDecide = `UPDATE floor_counter SET value = value - 1 WHERE name = $1 AND key = $2
RETURNING value, clock_timestamp()`

	// floorCreateRow runs only when floorDecide found no row (a key's first decision, in the
	// warm-up).
	floorCreateRow = `INSERT INTO floor_counter (name, key, value) VALUES ($1, $2, 0) ON CONFLICT DO NOTHING`
)

type floor struct{ env *Env }

func (c *floor) Decide(ctx context.Context, limit, key string) (Decision, error) {
	for attempt := 1; ; attempt++ {
		var (
			value int64
			at    time.Time
		)
		err := c.env.Pool.QueryRow(ctx, floorDecide, limit, key).Scan(&value, &at)
		if errors.Is(err, pgx.ErrNoRows) && attempt == 1 {
			if _, err := c.env.Pool.Exec(ctx, floorCreateRow, limit, key); err != nil {
				return Decision{}, fmt.Errorf("floor: create row: %w", err)
			}
			continue
		}
		if err != nil {
			return Decision{}, fmt.Errorf("floor: %w", err)
		}
		return Decision{Allowed: true, At: at}, nil
	}
}

func (c *floor) Close() {}
