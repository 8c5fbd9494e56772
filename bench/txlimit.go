package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/txlimit/txlimit/ratelimit"
)

// newTxlimit returns a ratelimit.Limiter with env's limits registered, each split over shards.
func newTxlimit(env *Env, shards int) (*ratelimit.Limiter, error) {
	limits := make(map[string]ratelimit.Config, len(env.Limits))
	for _, l := range env.Limits {
		limits[l.Name] = ratelimit.Config{Rate: l.Rate, Period: l.Period, Capacity: l.Burst, Shards: shards}
	}
	return ratelimit.New(&ratelimit.LimiterConfig{Limits: limits})
}

// txlimitPool decides each call on the pool: one statement, its own implicit transaction.
type txlimitPool struct {
	env *Env
	lim *ratelimit.Limiter
}

func (c *txlimitPool) Decide(ctx context.Context, limit, key string) (Decision, error) {
	r, err := c.lim.Limit(ctx, c.env.Pool, limit, key, nil)
	if err != nil {
		return Decision{}, err
	}
	return Decision{Allowed: r.OK, At: r.Time}, nil
}

func (c *txlimitPool) Close() {}

// txlimitSerializable decides each call inside its own SERIALIZABLE transaction run by
// ratelimit.InSerializableTx with its default retries, as an application that needs SERIALIZABLE
// for its own writes would.
type txlimitSerializable struct {
	env *Env
	lim *ratelimit.Limiter
}

func (c *txlimitSerializable) Decide(ctx context.Context, limit, key string) (Decision, error) {
	var (
		r     ratelimit.Result
		calls int
	)
	err := ratelimit.InSerializableTx(ctx, c.env.Pool, nil, func(ctx context.Context, tx pgx.Tx) error {
		if calls > 0 && Stopped(ctx) {
			return ErrStopped
		}
		calls++
		var err error
		r, err = c.lim.Limit(ctx, tx, limit, key, nil)
		return err
	})
	d := Decision{Retries: max(calls-1, 0)}
	if err != nil {
		return d, fmt.Errorf("txlimit in SERIALIZABLE: %w", err)
	}
	d.Allowed, d.At = r.OK, r.Time
	return d, nil
}

func (c *txlimitSerializable) Close() {}

// txlimitBatched decides each call through a ratelimit.Batcher on the pool.
type txlimitBatched struct{ b *ratelimit.Batcher }

func (c *txlimitBatched) Decide(ctx context.Context, limit, key string) (Decision, error) {
	r, err := c.b.Limit(ctx, limit, key, nil)
	if err != nil {
		return Decision{}, err
	}
	return Decision{Allowed: r.OK, At: r.Time}, nil
}

func (c *txlimitBatched) Close() { c.b.Close() }
