//go:build reliability

package reliability_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/txlimit/txlimit/ratelimit"
)

// soakBatchBound is how long a Batcher call may take to return, whatever happens to its batch:
// its context's timeout plus a generous margin for a loaded machine under the race detector.
const (
	soakBatchTimeout = 20 * time.Second
	soakBatchBound   = 2 * soakBatchTimeout
)

// soakBatch is the soak's Batcher and its own ledger. A Batcher decides outside the workers'
// transactions (one autocommit statement, or one transaction of its own, per batch), so its grants
// cannot be written to soak_ledger in the same transaction. Instead, a call that returned a result
// is known exactly and kept here; a call that returned an error (its backend terminated, its
// context ended in flight) may or may not have been charged, and its counts are kept as unknown.
// verify then requires, for every (limit, key), that the stored value is exactly what soak_ledger,
// the known Batcher grants and the refill imply, less the counts of some subset of the unknown
// calls: exact equality when no Batcher call on the key failed.
type soakBatch struct {
	b *ratelimit.Batcher

	mu      sync.Mutex
	known   map[[2]string]float64   // (name, key) -> sum of the known deltas (-count per grant)
	unknown map[[2]string][]float64 // (name, key) -> counts of the calls with an unknown outcome

	calls, errs, batchedCalls, maxBatched atomic.Int64
	explained                             atomic.Int64 // verify's checks that needed unknown outcomes
	slowest                               atomic.Int64 // nanoseconds
}

// startBatcher makes s's Batcher on the workers' pool (whose backends the killer terminates) and
// runs n workers deciding through it until deadline, on the same limits and keys as the
// transactional workers. It returns when they are done and the Batcher is closed.
func (s *soakRun) startBatcher(n int, seed uint64, deadline time.Time) (wait func()) {
	b, err := ratelimit.NewBatcher(s.pool, s.lim, nil)
	if err != nil {
		s.failf("NewBatcher: %v", err)
		return func() {}
	}
	s.batch = &soakBatch{b: b, known: map[[2]string]float64{}, unknown: map[[2]string][]float64{}}
	var wg sync.WaitGroup
	for w := range n {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(1<<32+w)))
			for time.Now().Before(deadline) && s.failures.Load() == 0 {
				s.batchOnce(rng)
			}
		})
	}
	return func() {
		wg.Wait()
		b.Close()
	}
}

// batchOnce makes one call through the Batcher: LimitN (sometimes reserving), LimitMany, CheckN or
// CheckMany, with the transactional workers' limits, keys and count rules (READ COMMITTED ones:
// a sharded limit is charged 1 token at a time, never with Reserve).
func (s *soakRun) batchOnce(rng *rand.Rand) {
	defer func() {
		if r := recover(); r != nil {
			s.failf("batcher: panic: %v\n%s", r, debug.Stack())
		}
	}()
	p := s.pick(rng)
	var reqs []soakReq
	switch {
	case p.kind == soakOpMany || p.kind == soakOpReserveMany:
		reqs = p.reqs
	default:
		reqs = p.reqs[:1]
	}
	for i := range reqs {
		reqs[i].count = soakReqCount(rng, reqs[i].lim, false)
		reqs[i].reserve = reqs[i].lim.reserve && rng.IntN(3) == 0
	}
	dry := rng.IntN(5) == 0
	s.nextOp.Add(1)
	s.clock.tick()
	kind := "batcher"
	if dry {
		kind = "batcher_check"
	}
	v, _ := s.opsByKind.LoadOrStore(kind, &atomic.Int64{})
	v.(*atomic.Int64).Add(1)

	ctx, cancel := context.WithTimeout(context.Background(), soakBatchTimeout)
	defer cancel()
	bt := s.batch
	start := time.Now()
	var (
		res ratelimit.ManyResult
		err error
	)
	if len(reqs) == 1 {
		r := reqs[0]
		opts := &ratelimit.LimitOpts{Reserve: r.reserve}
		var one ratelimit.Result
		if dry {
			one, err = bt.b.CheckN(ctx, r.lim.name, r.key, r.count, opts)
		} else {
			one, err = bt.b.LimitN(ctx, r.lim.name, r.key, r.count, opts)
		}
		res = ratelimit.ManyResult{OK: one.OK, Results: []ratelimit.Result{one}, Batched: one.Batched}
	} else {
		rs := make([]ratelimit.Request, len(reqs))
		for i, r := range reqs {
			rs[i] = ratelimit.Request{Name: r.lim.name, Key: r.key, Count: r.count, Reserve: r.reserve}
		}
		if dry {
			res, err = bt.b.CheckMany(ctx, rs, nil)
		} else {
			res, err = bt.b.LimitMany(ctx, rs, nil)
		}
	}
	took := time.Since(start)
	bt.calls.Add(1)
	for {
		old := bt.slowest.Load()
		if int64(took) <= old || bt.slowest.CompareAndSwap(old, int64(took)) {
			break
		}
	}
	if took > soakBatchBound {
		s.failf("batcher: a call took %s to return (bound %s)", took, soakBatchBound)
	}

	if err != nil {
		bt.errs.Add(1)
		s.errs.add(fmt.Errorf("batcher: %w", err))
		if soakBug(err) || errors.Is(err, ratelimit.ErrBatcherClosed) {
			s.failf("batcher: %v", err)
		}
		if res.OK {
			s.failf("batcher: a result said OK with error %v", err)
		}
		if !dry {
			bt.mu.Lock()
			for _, r := range reqs {
				k := [2]string{r.lim.name, r.key}
				bt.unknown[k] = append(bt.unknown[k], r.count)
			}
			bt.mu.Unlock()
		}
		return
	}
	if res.Batched < 1 || len(res.Results) != len(reqs) {
		s.failf("batcher: Batched %d with %d results for %d requests", res.Batched, len(res.Results), len(reqs))
	}
	bt.batchedCalls.Add(int64(res.Batched))
	for {
		old := bt.maxBatched.Load()
		if int64(res.Batched) <= old || bt.maxBatched.CompareAndSwap(old, int64(res.Batched)) {
			break
		}
	}
	var single *soakLimit
	if len(reqs) == 1 {
		single = reqs[0].lim
	}
	s.decided(single, res.OK)
	if res.OK && !dry {
		bt.mu.Lock()
		for _, r := range reqs {
			bt.known[[2]string{r.lim.name, r.key}] -= r.count
		}
		bt.mu.Unlock()
	}
}

// knownDelta is the change the Batcher's answered calls made to (name, key); 0 without a Batcher.
func (bt *soakBatch) knownDelta(name, key string) float64 {
	if bt == nil {
		return 0
	}
	bt.mu.Lock()
	defer bt.mu.Unlock()
	return bt.known[[2]string{name, key}]
}

// explains reports whether implied - stored is exactly the sum of some subset of the counts of
// the Batcher calls on (name, key) whose outcome is unknown (0 when there are none). Counts are
// integers (see soakLimit), so the subset sums are computed exactly as a bit set.
func (bt *soakBatch) explains(name, key string, stored, implied float64) bool {
	diff := implied - stored
	if diff == 0 {
		return true
	}
	if bt == nil || diff < 0 || diff != math.Trunc(diff) {
		return false
	}
	bt.mu.Lock()
	counts := bt.unknown[[2]string{name, key}]
	bt.mu.Unlock()
	sums := big.NewInt(1) // bit i set: i is a subset sum
	for _, c := range counts {
		sums.Or(sums, new(big.Int).Lsh(sums, uint(c)))
	}
	ok := diff <= float64(sums.BitLen()) && sums.Bit(int(diff)) == 1
	if ok {
		bt.explained.Add(1)
	}
	return ok
}

// summary describes what the Batcher's workers did, for the log.
func (bt *soakBatch) summary() string {
	if bt == nil {
		return "no Batcher"
	}
	bt.mu.Lock()
	unknown := 0
	for _, c := range bt.unknown {
		unknown += len(c)
	}
	bt.mu.Unlock()
	calls := bt.calls.Load()
	avg := 0.0
	if ok := calls - bt.errs.Load(); ok > 0 {
		avg = float64(bt.batchedCalls.Load()) / float64(ok)
	}
	return fmt.Sprintf("Batcher: %d calls, %d errors (%d charging requests of unknown outcome; %d ledger checks held only with some of them charged), mean batch %.2f, largest %d, slowest call %s (bound %s)",
		calls, bt.errs.Load(), unknown, bt.explained.Load(), avg, bt.maxBatched.Load(), time.Duration(bt.slowest.Load()).Round(time.Millisecond), soakBatchBound)
}
