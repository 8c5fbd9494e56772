package scheduler_test

import (
	"context"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/riverqueue/river"

	"github.com/txlimit/txlimit/ratelimit"
	"github.com/txlimit/txlimit/scheduler"
)

// BenchmarkLateness measures how late reserved jobs start after their ScheduledAt: 200 jobs per
// iteration, reserved from a 100/s limit so that they fall due every 10 ms over 2 s, starting 1.5 s
// after they are inserted. It reports the p50, p99 and max lateness in milliseconds.
//
// "precise" is this package's setup (PreciseHook, PreciseQueue); "river-scheduled" is River alone
// (jobs inserted as scheduled, default queue config) for comparison.
//
//	go test -run '^$' -bench BenchmarkLateness -benchtime 1x ./scheduler/
func BenchmarkLateness(b *testing.B) {
	b.Run("precise", func(b *testing.B) { benchLateness(b, true) })
	b.Run("river-scheduled", func(b *testing.B) { benchLateness(b, false) })
}

func benchLateness(b *testing.B, precise bool) {
	const (
		n      = 200
		rate   = 100              // tokens per second: a job every 10 ms
		lead   = 150              // tokens reserved up front: the first job is due 1.5 s out
		inputs = 8                // concurrent inserting transactions
		wait   = 30 * time.Second // per iteration, generous
		cfgKey = "bench"
	)
	ctx := context.Background()
	pool := runConn.pool(b, 24, allTables)
	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		cfgKey: {Rate: rate, Period: time.Second, Capacity: 1, MaxReserved: ratelimit.Unbounded},
	}})
	if err != nil {
		b.Fatal(err)
	}
	var (
		mu     sync.Mutex
		starts = map[int64]time.Time{}
		ch     = make(chan struct{}, n*b.N+1)
	)
	queue := river.QueueConfig{MaxWorkers: 50}
	if precise {
		queue = scheduler.PreciseQueue(50)
	}
	client := newClient(b, pool, &clientOpts{
		queues: map[string]river.QueueConfig{river.QueueDefault: queue},
		work: func(ctx context.Context, job *river.Job[callArgs]) error {
			now := time.Now()
			mu.Lock()
			starts[job.ID] = now
			mu.Unlock()
			ch <- struct{}{}
			return nil
		},
		noHook: !precise,
	})
	sched, err := scheduler.New(client, limiter, &scheduler.Config{AllowImprecise: !precise})
	if err != nil {
		b.Fatal(err)
	}
	startClient(b, client)

	var late []time.Duration
	ranNow := 0
	for i := 0; i < b.N; i++ {
		due := make(map[int64]time.Time, n)
		// Push the limit 1.5 s into debt so that every job is committed well before it is due.
		if _, err := limiter.LimitN(ctx, pool, cfgKey, "", lead, &ratelimit.LimitOpts{Reserve: true}); err != nil {
			b.Fatal(err)
		}
		var wg sync.WaitGroup
		var dmu sync.Mutex
		for w := range inputs {
			wg.Go(func() {
				for j := w; j < n; j += inputs {
					err := func() error { // READ COMMITTED: the hot row's lock orders the callers
						tx, err := pool.Begin(ctx)
						if err != nil {
							return err
						}
						defer tx.Rollback(ctx) //nolint:errcheck
						r, err := sched.ReserveTx(ctx, tx, cfgKey, "", 1, callArgs{N: j}, nil)
						if err != nil {
							return err
						}
						if err := tx.Commit(ctx); err != nil {
							return err
						}
						dmu.Lock()
						due[r.Job.ID] = r.ScheduledAt
						dmu.Unlock()
						return nil
					}()
					if err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		timeout := time.After(wait + 6*time.Second)
		for k := range n {
			select {
			case <-ch:
			case <-timeout:
				b.Fatalf("iteration %d: only %d of %d jobs started", i, k, n)
			}
		}
		mu.Lock()
		for id, at := range due {
			if at.IsZero() {
				// Its tokens were there: the machine reserved slower than the limit refilled
				// (a loaded machine), so the job ran at once and has no time to be late for.
				ranNow++
				continue
			}
			late = append(late, starts[id].Sub(at))
		}
		mu.Unlock()
	}
	slices.Sort(late)
	pct := func(p float64) float64 {
		k := max(int(math.Ceil(p*float64(len(late))))-1, 0)
		return float64(late[k]) / float64(time.Millisecond)
	}
	b.ReportMetric(float64(len(late)), "jobs")
	b.ReportMetric(float64(ranNow), "ran-now")
	b.ReportMetric(pct(0.50), "p50-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
	b.ReportMetric(pct(1), "max-ms")
	b.ReportMetric(float64(late[0])/float64(time.Millisecond), "min-ms")
}
