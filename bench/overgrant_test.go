package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"maps"
	"math"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestOverGrant runs the over-grant test (docs/spec.md §7) briefly against every txlimit contender: burst 10,
// rate 10/s, 64 goroutines on one key. It fails if any grants more than a bucket that starts full
// could: 10 + 10·span, span being the first to the last grant on Postgres's clock.
func TestOverGrant(t *testing.T) {
	const window = 2 * time.Second
	ctx := context.Background()
	env := testEnv(t)

	ran := 0
	for _, def := range Defs() {
		if def.Family != FamilyTxlimit || def.SweepOnly { // the sweep's 64 shards cannot hold the over-grant test's count
			continue
		}
		ran++
		t.Run(def.ID, func(t *testing.T) {
			c, err := def.New(ctx, env)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			o := RunOverGrant(ctx, c, def, limitOverGrant, "overgrant-test/"+def.ID, overGrantCallers, window)
			t.Logf("decisions %d allowed %d max %d (nominal %d, span %s) retries %d errors %d abandoned %d",
				o.Decisions, o.Allowed, o.Max, o.Nominal, o.Span, o.Retries, o.Errors, o.Abandoned)
			if o.Allowed == 0 {
				t.Fatalf("nothing was allowed in %s (errors: %d, first: %v)", window, o.Errors, o.FirstErr)
			}
			if o.Allowed > o.Max {
				t.Errorf("over-grant: allowed %d, at most %d could be (burst 10 + 10/s over %s)", o.Allowed, o.Max, o.Span)
			}
		})
	}
	if ran == 0 {
		t.Fatal("no txlimit contender is registered")
	}
}

// testEnv opens an Env on a schema of its own, without Redis, closed when t ends.
func testEnv(t *testing.T) *Env {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	env, closeEnv, err := OpenEnv(context.Background(), EnvOpts{Schema: "txlimit_bench_test_" + hex.EncodeToString(b[:]), NoRedis: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeEnv)
	return env
}

// TestContenderStatements: each Postgres contender sends per decision the statements the
// Contenders table says: txlimit one (its own implicit transaction, also through a Batcher, and
// sharded), in a SERIALIZABLE transaction three (BEGIN, the decision, COMMIT), the floor one
// autocommit UPDATE, the naive read-modify-write BEGIN, SELECT, UPSERT and COMMIT for a grant and
// no UPSERT for a denial. Each key is warmed up first (its row created, its statements prepared;
// on the deny-heavy limit, its burst spent; the shard sweep's contenders decide only the
// allow-heavy one).
func TestContenderStatements(t *testing.T) {
	ctx := context.Background()
	env := testEnv(t)
	want := map[string]int64{
		"txlimit": 1, "txlimit-batched": 1, "txlimit-ser": 3, "floor": 1, "naive-ser": 3, "naive-rc": 3,
		"txlimit-16": 1, "txlimit-16-ser": 3, "txlimit-4-ser": 3, "txlimit-64-ser": 3,
	}
	for _, def := range Defs() {
		if !def.Family.OnPostgres() {
			continue
		}
		c, err := def.New(ctx, env)
		if err != nil {
			t.Fatal(err)
		}
		for _, lim := range []Limit{limitAllow, limitDeny} {
			if def.SweepOnly && lim == limitDeny { // 64 shards of burst 10 hold no whole token
				continue
			}
			key, warmUps := "statements/"+def.ID, 1
			if lim == limitDeny {
				warmUps = 11
			}
			for range warmUps {
				if _, err := c.Decide(ctx, lim.Name, key); err != nil {
					t.Fatalf("%s, %s: warm-up: %v", def.ID, lim.Name, err)
				}
			}
			n0 := env.PGTrips.Load()
			d, err := c.Decide(ctx, lim.Name, key)
			if err != nil {
				t.Fatalf("%s, %s: %v", def.ID, lim.Name, err)
			}
			got, w := env.PGTrips.Load()-n0, want[def.ID]
			if def.ID == "naive-ser" || def.ID == "naive-rc" {
				if d.Allowed {
					w++ // the UPSERT
				}
			}
			if got != w {
				t.Errorf("%s, %s (allowed %v): %d statements, want %d", def.ID, lim.Name, d.Allowed, got, w)
			}
		}
		c.Close()
	}
}

// TestRedisTokenBucket: the Redis contender's script is a token bucket on Redis's clock, as the
// Contenders table says: a fresh key holds the burst, a key refills at the rate up to the burst
// from its ts, a ts ahead of the clock refills nothing, and a denial writes nothing. The rate is
// 0.001/s, so that the milliseconds the test takes refill nothing that shows. Skipped without Redis.
func TestRedisTokenBucket(t *testing.T) {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: DefaultRedis, DialTimeout: time.Second, MaxRetries: -1})
	defer rdb.Close()
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Skip("no Redis at", DefaultRedis, err)
	}
	sha, err := rdb.ScriptLoad(ctx, redisTokenBucket).Result()
	if err != nil {
		t.Fatal(err)
	}
	clock, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	now := clock.UnixMicro()
	prefix := fmt.Sprintf("txlimit-bench-test:%d:", time.Now().UnixNano())
	defer deleteRedisKeys(ctx, rdb, prefix)
	for _, tc := range []struct {
		name   string
		v      string // the stored level; "" for a fresh key
		ts     int64  // the stored ts, µs
		grants int
		left   float64 // the level after the grants
	}{
		{"fresh: the burst", "", 0, 10, 0},
		{"refilled 3 in 3000 s", "0", now - 3000e6, 3, 0},
		{"refilled up to the burst", "0.5", now - 1e12, 10, 0},
		{"a ts ahead: no refill", "2.5", now + 3600e6, 2, 0.5},
	} {
		key := prefix + tc.name
		if tc.v != "" {
			if err := rdb.HSet(ctx, key, "v", tc.v, "ts", tc.ts).Err(); err != nil {
				t.Fatal(err)
			}
		}
		decide := func() bool {
			res, err := rdb.EvalSha(ctx, sha, []string{key}, "0.001", "10", "1", "60000").Int64Slice()
			if err != nil {
				t.Fatal(err)
			}
			return res[0] == 1
		}
		grants := 0
		for range tc.grants {
			if decide() {
				grants++
			}
		}
		before, err := rdb.HGetAll(ctx, key).Result()
		if err != nil {
			t.Fatal(err)
		}
		for range 3 {
			if decide() {
				grants++
			}
		}
		after, err := rdb.HGetAll(ctx, key).Result()
		if err != nil {
			t.Fatal(err)
		}
		v, _ := strconv.ParseFloat(after["v"], 64)
		if grants != tc.grants || math.Abs(v-tc.left) > 1e-3 || !maps.Equal(before, after) {
			t.Errorf("%s: %d grants, left %v (before the denials %v); want %d grants, level %v, the denials writing nothing",
				tc.name, grants, after, before, tc.grants, tc.left)
		}
	}
}

// scripted is a fake contender: its calls return script's decisions in turn, then after's.
type scripted struct {
	mu     sync.Mutex
	script []Decision
	after  Decision
}

func (c *scripted) Decide(context.Context, string, string) (Decision, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.script) == 0 {
		return c.after, nil
	}
	d := c.script[0]
	c.script = c.script[1:]
	return d, nil
}

func (c *scripted) Close() {}

// TestOverGrantBound: the bound of RunOverGrant (burst 10 + rate 10/s over span) runs from the
// first to the last grant. A bucket that starts full can grant 10 at its first grant and one more
// per 100 ms after it; denials that come later add nothing to what it may have granted, so they
// must not stretch span (with them, a limiter that granted one too many passed as long as it went
// on denying for another 100 ms).
func TestOverGrantBound(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	grants := func(n int, at time.Time) []Decision {
		out := make([]Decision, n)
		for i := range out {
			out[i] = Decision{Allowed: true, At: at}
		}
		return out
	}
	for _, tc := range []struct {
		name     string
		script   []Decision
		deniedAt time.Time
		span     time.Duration
		max      int64
	}{
		// 11 grants at one instant, then denials 100 ms later: one grant too many.
		{"over by one", grants(11, t0), t0.Add(100 * time.Millisecond), 0, 10},
		// 10 grants, an 11th 100 ms later (a token refilled), then denials: within the bound.
		{"refilled", append(grants(10, t0), grants(1, t0.Add(100*time.Millisecond))...), t0.Add(150 * time.Millisecond), 100 * time.Millisecond, 11},
	} {
		c := &scripted{script: tc.script, after: Decision{At: tc.deniedAt}}
		o := RunOverGrant(context.Background(), c, &Def{ID: "scripted"}, limitOverGrant, "k", 2, 100*time.Millisecond)
		if o.Allowed != 11 || o.Span != tc.span || o.Max != tc.max || o.Decisions <= 11 {
			t.Errorf("%s: decisions %d allowed %d span %s max %d; want more than 11 decisions, 11 allowed, span %s, max %d",
				tc.name, o.Decisions, o.Allowed, o.Span, o.Max, tc.span, tc.max)
		}
	}
}
