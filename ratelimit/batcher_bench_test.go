package ratelimit_test

import (
	"strconv"
	"testing"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// BenchmarkBatcher measures Batcher.Limit with the default config, by callers per GOMAXPROCS
// (par), one hot key or one key per caller, and a generous (every call written) or tight (every
// call denied) limit. The comparison with Redis and the rest is the bench/ module (make bench);
// this is for profiling:
//
//	go test ./ratelimit -run '^$' -bench Batcher -benchtime 3s
func BenchmarkBatcher(b *testing.B) {
	for _, par := range []int{1, 16} {
		for _, scenario := range []string{"hot", "peruser"} {
			for _, limit := range []string{"generous", "tight"} {
				b.Run("par="+strconv.Itoa(par)+"/"+scenario+"/"+limit, func(b *testing.B) {
					bt, ctx := benchBatcher(b, nil)
					benchParallel(b, par, scenario == "peruser", func(key string) error {
						_, err := bt.Limit(ctx, limit, key, nil)
						return err
					})
				})
			}
		}
	}
}

// BenchmarkBatcherLanes compares lane counts (BatcherConfig.Lanes) where they matter: 64 callers
// (32 per GOMAXPROCS on the 2-core machine the default was measured on), one key each, a generous
// or a tight limit. The README says how these and make bench's per-user cells chose the default:
//
//	go test ./ratelimit -run '^$' -bench BatcherLanes -benchtime 3s -count 3
func BenchmarkBatcherLanes(b *testing.B) {
	for _, limit := range []string{"generous", "tight"} {
		for _, lanes := range []int{1, 2, 4} {
			b.Run(limit+"/lanes="+strconv.Itoa(lanes), func(b *testing.B) {
				bt, ctx := benchBatcher(b, &ratelimit.BatcherConfig{Lanes: lanes})
				benchParallel(b, 32, true, func(key string) error {
					_, err := bt.Limit(ctx, limit, key, nil)
					return err
				})
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
			})
		}
	}
}

// BenchmarkBatchStatement measures one batch alone, as a Batcher's lane sends it: n Limit calls
// decided as one list in one statement on one connection, batch after batch, with nothing else
// running. ns/op is the time of one batch, from the Go side's encoding to its results; the
// commit=on and commit=off runs differ only in synchronous_commit, so their difference is what the
// commit's WAL flush costs a batch that writes (a batch that only denies writes nothing and
// flushes nothing). Shapes: every call on one key (hot) or each on a key of its own (peruser); a
// generous limit (every call granted and written) or a tight one (every call denied). It shows how
// a lane's time per batch grows with the batch, the throughput a lane cannot exceed:
//
//	go test ./ratelimit -run '^$' -bench BatchStatement -benchtime 500x
func BenchmarkBatchStatement(b *testing.B) {
	for _, commit := range []string{"on", "off"} {
		for _, scenario := range []string{"hot", "peruser"} {
			for _, limit := range []string{"generous", "tight"} {
				for _, n := range []int{1, 32, 64} {
					name := "commit=" + commit + "/" + scenario + "/" + limit + "/n=" + strconv.Itoa(n)
					b.Run(name, func(b *testing.B) {
						pool := testdb.Pool(b, &testdb.Options{MaxConns: 1,
							RuntimeParams: map[string]string{"synchronous_commit": commit}})
						lim, ctx := benchLimiter(b)
						calls := make([]ratelimit.ListCall, n)
						for i := range calls {
							key := "hot"
							if scenario == "peruser" {
								key = strconv.Itoa(i)
							}
							calls[i] = ratelimit.ListCall{Single: true, Reqs: []ratelimit.Request{{Name: limit, Key: key}}}
						}
						// Once first: the rows exist, and the tight limit is spent.
						if _, _, err := ratelimit.DecideList(ctx, lim, pool, calls); err != nil {
							b.Fatal(err)
						}
						for b.Loop() {
							if _, _, err := ratelimit.DecideList(ctx, lim, pool, calls); err != nil {
								b.Fatal(err)
							}
						}
						b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "decisions/s")
					})
				}
			}
		}
	}
}
