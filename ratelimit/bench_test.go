package ratelimit_test

import (
	"context"
	"fmt"
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
	benchParallel(b, 4, true, func(key string) error {
		_, err := lim.Limit(ctx, pool, "generous", key, nil)
		return err
	})
}

func BenchmarkLimitHotKey(b *testing.B) {
	for _, name := range []string{"generous", "sharded"} {
		b.Run(name, func(b *testing.B) {
			pool := testdb.Pool(b, &testdb.Options{MaxConns: 16})
			lim, ctx := benchLimiter(b)
			benchParallel(b, 8, false, func(key string) error {
				_, err := lim.Limit(ctx, pool, name, key, nil)
				return err
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
	benchParallel(b, 4, false, func(string) error {
		if r, err := lim.Limit(ctx, pool, "tight", "k", nil); err != nil || r.OK {
			return fmt.Errorf("want a denial: OK %t, error %v", r.OK, err)
		}
		return nil
	})
}

// benchParallel times b.N calls of call, made by par goroutines per GOMAXPROCS. Each goroutine
// passes a key of its own ("1", "2", …) when perCaller, else "hot".
func benchParallel(b *testing.B, par int, perCaller bool, call func(key string) error) {
	var n atomic.Int64
	b.SetParallelism(par)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		key := "hot"
		if perCaller {
			key = strconv.FormatInt(n.Add(1), 10)
		}
		for pb.Next() {
			if err := call(key); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// benchBatcher returns a Batcher of cfg on benchLimiter's limits, on a pool of 8 connections,
// closed when the benchmark ends.
func benchBatcher(b *testing.B, cfg *ratelimit.BatcherConfig) (*ratelimit.Batcher, context.Context) {
	pool := testdb.Pool(b, &testdb.Options{MaxConns: 8})
	lim, ctx := benchLimiter(b)
	bt, err := ratelimit.NewBatcher(pool, lim, cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(bt.Close)
	return bt, ctx
}
