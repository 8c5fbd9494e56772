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

	"github.com/txlimit/txlimit/migrations"
)

// DefaultDSN is the Postgres used when neither BENCH_DATABASE_URL nor TEST_DATABASE_URL is set.
const DefaultDSN = "postgres://postgres@localhost:5432/test?sslmode=disable"

// DefaultRedis is the Redis address used when BENCH_REDIS_ADDR is not set.
const DefaultRedis = "127.0.0.1:6379"

// MaxConns bounds the Postgres pool: the most callers of any scenario. Postgres has
// max_connections = 100 on the reference machine and other people use it too.
const MaxConns = 64

// dsn returns the Postgres connection string and the variable it came from.
func dsn() (string, string) {
	for _, v := range []string{"BENCH_DATABASE_URL", "TEST_DATABASE_URL"} {
		if u := os.Getenv(v); u != "" {
			return u, v
		}
	}
	return DefaultDSN, "default"
}

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

// OpenEnv creates and migrates the schema, opens the pool and, when it answers, Redis. The returned
// close function drops the schema, deletes the run's Redis keys and closes everything.
func OpenEnv(ctx context.Context, opts EnvOpts) (*Env, func(), error) {
	url, _ := dsn()
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, nil, fmt.Errorf("bench: connect to Postgres (set BENCH_DATABASE_URL or TEST_DATABASE_URL, else %s is used): %w", DefaultDSN, err)
	}
	schema := pgx.Identifier{opts.Schema}.Sanitize()
	// A schema left by an interrupted run is replaced.
	if _, err := admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
		admin.Close(ctx)
		return nil, nil, fmt.Errorf("bench: drop old schema: %w", err)
	}
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		admin.Close(ctx)
		return nil, nil, fmt.Errorf("bench: create schema: %w", err)
	}
	env := &Env{PGTrips: &pgCounter{}, RedisTrips: &redisCounter{}, Limits: benchLimits}
	closeAll := func() {
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if env.Pool != nil {
			env.Pool.Close()
		}
		if env.Redis != nil {
			deleteRedisKeys(c, env.Redis, env.RedisPrefix)
			_ = env.Redis.Close()
		}
		if _, err := admin.Exec(c, "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
			fmt.Fprintf(os.Stderr, "bench: drop schema %s: %v\n", opts.Schema, err)
		}
		admin.Close(c)
	}

	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		closeAll()
		return nil, nil, fmt.Errorf("bench: parse DSN: %w", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = opts.Schema
	cfg.ConnConfig.Tracer = env.PGTrips
	cfg.MaxConns = MaxConns
	env.Pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		closeAll()
		return nil, nil, fmt.Errorf("bench: open pool: %w", err)
	}
	if err := migrations.Up(ctx, env.Pool); err != nil {
		closeAll()
		return nil, nil, fmt.Errorf("bench: migrate schema %s: %w", opts.Schema, err)
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
		env.RedisErr = fmt.Errorf("Redis at %s (BENCH_REDIS_ADDR) does not answer: %w", addr, err)
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
