package main

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// redisTokenBucket is the Redis contender: a token bucket in a Lua script, run atomically by Redis
// with EVALSHA, one round trip per decision. It reads Redis's own clock (TIME), as txlimit reads
// Postgres's, so clients with skewed clocks agree; time never runs backwards for a bucket.
// A denial writes nothing. Numbers are stored with 17 significant digits so that they round-trip
// exactly (Redis would format a bare Lua number with 14).
//
// KEYS[1] bucket; ARGV[1] refill per second, ARGV[2] burst, ARGV[3] cost, ARGV[4] TTL in ms.
// Returns {1 if granted else 0, the decision time in microseconds since the Unix epoch}.
const redisTokenBucket = `
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local per_us = tonumber(ARGV[1]) / 1000000
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local level, ts = burst, now
local row = redis.call('HMGET', KEYS[1], 'v', 'ts')
if row[1] then
  level = tonumber(row[1])
  ts = tonumber(row[2])
  if now > ts then
    level = math.min(burst, level + (now - ts) * per_us)
    ts = now
  end
end
if level < cost then
  return {0, now}
end
redis.call('HSET', KEYS[1], 'v', string.format('%.17g', level - cost), 'ts', string.format('%.0f', ts))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, now}
`

type redisLua struct {
	rdb    *redis.Client
	sha    string
	prefix string
	args   map[string][]any // per limit name; read-only after New
}

func (c *redisLua) Decide(ctx context.Context, limit, key string) (Decision, error) {
	args, ok := c.args[limit]
	if !ok {
		return Decision{}, fmt.Errorf("redis: unknown limit %q", limit)
	}
	res, err := c.rdb.EvalSha(ctx, c.sha, []string{c.prefix + limit + ":" + key}, args...).Int64Slice()
	if err != nil {
		return Decision{}, fmt.Errorf("redis: EVALSHA: %w", err)
	}
	if len(res) != 2 {
		return Decision{}, fmt.Errorf("redis: script returned %d values, want 2", len(res))
	}
	return Decision{Allowed: res[0] == 1, At: time.UnixMicro(res[1])}, nil
}

func (c *redisLua) Close() {}
