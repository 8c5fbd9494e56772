package ratelimit_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// Benchmarks of single decisions on a pool. The side-by-side comparison with Redis and others is
// the bench/ module (make bench); these are for profiling the statement itself:
//
//	go test ./ratelimit -run '^$' -bench . -benchtime 3s
func benchLimiter(b *testing.B) (*ratelimit.Limiter, context.Context) {
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"generous": {Rate: 1e9, Period: time.Second},
		"sharded":  {Rate: 1e9, Period: time.Second, Shards: 16},
		"tight":    {Rate: 1, Period: time.Hour},
	}})
	if err != nil {
		b.Fatal(err)
	}
	return lim, context.Background()
}

func BenchmarkLimitPerUser(b *testing.B) {
	pool := testdb.Pool(b, &testdb.Options{MaxConns: 16})
	lim, ctx := benchLimiter(b)
	var n atomic.Int64
	b.SetParallelism(4)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		key := strconv.FormatInt(n.Add(1), 10)
		for pb.Next() {
			if _, err := lim.Limit(ctx, pool, "generous", key, nil); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

func BenchmarkLimitHotKey(b *testing.B) {
	for _, name := range []string{"generous", "sharded"} {
		b.Run(name, func(b *testing.B) {
			pool := testdb.Pool(b, &testdb.Options{MaxConns: 16})
			lim, ctx := benchLimiter(b)
			b.SetParallelism(8)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := lim.Limit(ctx, pool, name, "hot", nil); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

func BenchmarkDenial(b *testing.B) {
	pool := testdb.Pool(b, &testdb.Options{MaxConns: 16})
	lim, ctx := benchLimiter(b)
	if _, err := lim.Limit(ctx, pool, "tight", "k", nil); err != nil {
		b.Fatal(err)
	}
	b.SetParallelism(4)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if r, err := lim.Limit(ctx, pool, "tight", "k", nil); err != nil || r.OK {
				b.Error("want a denial", err)
				return
			}
		}
	})
}
