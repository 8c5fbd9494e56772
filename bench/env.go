package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/txlimit/txlimit/internal/devdb"
)

// EnvURL is the environment variable that names the bench's Postgres; TEST_DATABASE_URL is read
// after it. Defaults to unset: then the Postgres is found or started as the tests' is (package
// internal/devdb).
const EnvURL = "BENCH_DATABASE_URL"

// DefaultRedis is the Redis address used when BENCH_REDIS_ADDR is not set.
const DefaultRedis = "127.0.0.1:6379"

// MaxConns bounds the Postgres pool: the most callers of any scenario. Postgres has
// max_connections = 100 on the reference machine and other people use it too.
const MaxConns = 64

// pgCounter is a pgx QueryTracer that counts statements: one per round trip, since the bench
// sends no batches.
type pgCounter struct{ n atomic.Int64 }

func (c *pgCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *pgCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// Load returns the count so far.
func (c *pgCounter) Load() int64 { return c.n.Load() }

// redisCounter is a go-redis hook that counts commands and pipelines: one per round trip.
type redisCounter struct{ n atomic.Int64 }

func (c *redisCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *redisCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

func (c *redisCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmds)
	}
}

// Load returns the count so far.
func (c *redisCounter) Load() int64 { return c.n.Load() }

// EnvOpts tune OpenEnv.
type EnvOpts struct {
	// Schema is the Postgres schema to create, migrate and drop. It must be a plain identifier.
	Schema string
	// NoRedis leaves Redis out.
	NoRedis bool
}

// OpenEnv finds or starts a Postgres, creates and migrates the schema, opens the pool and, when it
// answers, Redis. The returned close function drops the schema, deletes the run's Redis keys, closes
// everything and stops a Postgres it started.
func OpenEnv(ctx context.Context, opts EnvOpts) (*Env, func(), error) {
	db, err := devdb.Find(ctx, EnvURL, devdb.EnvTestURL)
	if err != nil {
		return nil, nil, fmt.Errorf("bench: %w", err)
	}
	env := &Env{PGTrips: &pgCounter{}, RedisTrips: &redisCounter{}, Limits: benchLimits, PGFrom: db.String(),
		PGThrowaway: db.From == devdb.FromCluster}
	// A schema left by an interrupted run is replaced.
	pool, closePool, err := devdb.OpenSchema(ctx, db.URL, opts.Schema, &devdb.SchemaOpts{
		Configure: func(cfg *pgxpool.Config) {
			cfg.ConnConfig.Tracer = env.PGTrips
			cfg.MaxConns = MaxConns
		},
	})
	if err != nil {
		_ = db.Stop()
		return nil, nil, fmt.Errorf("bench: %w", err)
	}
	env.Pool = pool
	closeAll := func() {
		if env.Redis != nil {
			c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			deleteRedisKeys(c, env.Redis, env.RedisPrefix)
			cancel()
			_ = env.Redis.Close()
		}
		if err := closePool(); err != nil {
			fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		}
		_ = db.Stop()
	}

	if opts.NoRedis {
		env.RedisErr = errors.New("not used")
		return env, closeAll, nil
	}
	addr := os.Getenv("BENCH_REDIS_ADDR")
	if addr == "" {
		addr = DefaultRedis
	}
	rdb := redis.NewClient(&redis.Options{
		Addr:         addr,
		PoolSize:     MaxConns,
		DialTimeout:  2 * time.Second,
		MaxRetries:   -1, // a retried EVALSHA could consume twice; count errors instead
		ReadTimeout:  5 * time.Second,
		WriteTimeout: 5 * time.Second,
	})
	pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		_ = rdb.Close()
		env.RedisErr = fmt.Errorf("no answer from Redis at %s (BENCH_REDIS_ADDR): %w", addr, err)
		return env, closeAll, nil
	}
	rdb.AddHook(env.RedisTrips)
	env.Redis = rdb
	env.RedisPrefix = fmt.Sprintf("txlimit-bench:%d:", time.Now().UnixNano())
	return env, closeAll, nil
}

// deleteRedisKeys removes the keys of this run (they also expire by themselves).
func deleteRedisKeys(ctx context.Context, rdb *redis.Client, prefix string) {
	if prefix == "" {
		return
	}
	iter := rdb.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	var keys []string
	for iter.Next(ctx) && len(keys) < 1_000_000 {
		keys = append(keys, iter.Val())
	}
	for len(keys) > 0 {
		n := min(len(keys), 500)
		_ = rdb.Unlink(ctx, keys[:n]...).Err()
		keys = keys[n:]
	}
}

// walLSN returns Postgres's current WAL position.
func walLSN(ctx context.Context, pool *pgxpool.Pool) (string, error) {
	var lsn string
	err := pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&lsn)
	return lsn, err
}

// walDiff returns the bytes of WAL written between two positions.
func walDiff(ctx context.Context, pool *pgxpool.Pool, from, to string) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, "SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint", to, from).Scan(&n)
	return n, err
}
