package main

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txlimit/txlimit/ratelimit"
)

// contenders is every contender, in the order of the report's tables. Adding a contender is adding
// one entry here (and its type, in the file of its family: txlimit.go, postgres.go, redis.go,
// memory.go).
var contenders = []*Def{
	{
		ID:     "txlimit",
		Name:   "txlimit (pool)",
		What:   "Limiter.Limit on the pool: one statement in its own implicit transaction (the default path).",
		Family: FamilyTxlimit,
		New: func(_ context.Context, env *Env) (Contender, error) {
			lim, err := newTxlimit(env, 1)
			if err != nil {
				return nil, err
			}
			return &txlimitPool{env: env, lim: lim}, nil
		},
	},
	{
		ID:     "txlimit-batched",
		Name:   "txlimit batched (pool)",
		What:   "Batcher.Limit with the default BatcherConfig (unless -lanes says otherwise): calls queued while their lane decides are decided together, one commit per batch.",
		Family: FamilyTxlimit,
		New: func(_ context.Context, env *Env) (Contender, error) {
			lim, err := newTxlimit(env, 1)
			if err != nil {
				return nil, err
			}
			b, err := ratelimit.NewBatcher(env.Pool, lim, env.Batcher)
			if err != nil {
				return nil, err
			}
			return &txlimitBatched{b: b}, nil
		},
	},
	{
		ID:     "txlimit-ser",
		Name:   "txlimit in SERIALIZABLE tx",
		What:   "Limiter.Limit inside its own SERIALIZABLE transaction, run and retried by ratelimit.InSerializableTx (defaults: 10 attempts, 2-200 ms jittered backoff).",
		Family: FamilyTxlimit,
		New: func(_ context.Context, env *Env) (Contender, error) {
			lim, err := newTxlimit(env, 1)
			if err != nil {
				return nil, err
			}
			return &txlimitSerializable{env: env, lim: lim}, nil
		},
	},
	{
		ID:     "redis-lua",
		Name:   "Redis Lua (EVALSHA)",
		What:   "A token bucket in a Lua script run by EVALSHA (the usual way to rate-limit with Redis), on Redis's clock; go-redis v9, pool of 64.",
		Family: FamilyRedis,
		New: func(ctx context.Context, env *Env) (Contender, error) {
			if env.Redis == nil {
				return nil, &SkipError{Reason: fmt.Sprint(env.RedisErr)}
			}
			sha, err := env.Redis.ScriptLoad(ctx, redisTokenBucket).Result()
			if err != nil {
				return nil, fmt.Errorf("redis: SCRIPT LOAD: %w", err)
			}
			c := &redisLua{rdb: env.Redis, sha: sha, prefix: env.RedisPrefix, args: map[string][]any{}}
			for _, l := range env.Limits {
				ttl := time.Duration(l.Burst/l.PerSecond()*float64(time.Second)) + time.Minute
				c.args[l.Name] = []any{
					strconv.FormatFloat(l.PerSecond(), 'g', -1, 64),
					strconv.FormatFloat(l.Burst, 'g', -1, 64),
					"1",
					strconv.FormatInt(min(ttl, time.Hour).Milliseconds(), 10),
				}
			}
			return c, nil
		},
	},
	{
		ID:        "floor",
		Name:      "floor: UPDATE … RETURNING",
		What:      "Not a limiter: one autocommit UPDATE of one existing row per (limit, key), value = value - 1 RETURNING, on the pool. The least a durable one-statement decision can cost.",
		Family:    FamilyPostgres,
		NotALimit: true,
		New: func(ctx context.Context, env *Env) (Contender, error) {
			if _, err := env.Pool.Exec(ctx, floorCreateTable); err != nil {
				return nil, fmt.Errorf("floor: create table: %w", err)
			}
			return &floor{env: env}, nil
		},
	},
	{
		ID:     "naive-ser",
		Name:   "naive SERIALIZABLE read-modify-write",
		What:   "SELECT the bucket, decide in Go, UPSERT, in one SERIALIZABLE transaction (4 statements; a denial writes nothing, so 3), retried on 40001/40P01, up to 20 attempts, with 1-50 ms jittered backoff.",
		Family: FamilyPostgres,
		New: func(ctx context.Context, env *Env) (Contender, error) {
			if _, err := env.Pool.Exec(ctx, naiveCreateTable); err != nil {
				return nil, fmt.Errorf("naive: create table: %w", err)
			}
			return &naive{env: env, iso: pgx.Serializable}, nil
		},
	},
	{
		ID:            "naive-rc",
		Name:          "naive READ COMMITTED read-modify-write",
		What:          "As the naive SERIALIZABLE contender, at READ COMMITTED (Postgres's default), so with nothing to retry; run only in the over-grant test: what deciding with a read in Go and a write back grants.",
		Family:        FamilyPostgres,
		OverGrantOnly: true,
		New: func(ctx context.Context, env *Env) (Contender, error) {
			if _, err := env.Pool.Exec(ctx, naiveCreateTable); err != nil {
				return nil, fmt.Errorf("naive: create table: %w", err)
			}
			return &naive{env: env, iso: pgx.ReadCommitted}, nil
		},
	},
	{
		ID:     "x-time-rate",
		Name:   "x/time/rate in memory",
		What:   "golang.org/x/time/rate, one Limiter per key in a sync.Map in this process: no network, no durability, not shared between servers (the ceiling).",
		Family: FamilyMemory,
		New: func(_ context.Context, env *Env) (Contender, error) {
			return &memoryLimiter{limits: env.Limits}, nil
		},
	},
	txlimitShardedDef("txlimit-16", "txlimit 16 shards (pool)", "As txlimit (pool) with Config.Shards = 16: the same total limit split over 16 rows.", 16, false, false),
	txlimitShardedDef("txlimit-16-ser", "txlimit 16 shards in SERIALIZABLE tx", "As txlimit in SERIALIZABLE tx with Config.Shards = 16.", 16, true, false),
	txlimitShardedDef("txlimit-4-ser", "txlimit 4 shards in SERIALIZABLE tx", "As txlimit in SERIALIZABLE tx with Config.Shards = 4; run only in the shard comparison.", 4, true, true),
	txlimitShardedDef("txlimit-64-ser", "txlimit 64 shards in SERIALIZABLE tx", "As txlimit in SERIALIZABLE tx with Config.Shards = 64; run only in the shard comparison.", 64, true, true),
}

// txlimitShardedDef is a txlimit contender whose limits are split over shards rows, on the pool or
// in SERIALIZABLE transactions.
func txlimitShardedDef(id, name, what string, shards int, serializable, sweepOnly bool) *Def {
	return &Def{
		ID: id, Name: name, What: what, Family: FamilyTxlimit, Shards: shards, SweepOnly: sweepOnly,
		New: func(_ context.Context, env *Env) (Contender, error) {
			lim, err := newTxlimit(env, shards)
			if err != nil {
				return nil, err
			}
			if serializable {
				return &txlimitSerializable{env: env, lim: lim}, nil
			}
			return &txlimitPool{env: env, lim: lim}, nil
		},
	}
}
