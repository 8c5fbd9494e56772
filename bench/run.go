package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"sync"
	"time"
)

// Scenario is where the callers' keys fall.
type Scenario string

const (
	HotKey  Scenario = "hot key"  // every caller uses one key: the most contention
	PerUser Scenario = "per user" // each caller has its own key: no contention
)

// Cell is one measurement: a contender, a scenario, a limit (the mix) and a number of callers.
type Cell struct {
	Scenario Scenario
	Limit    Limit
	Callers  int
}

// Mix names the cell's decision mix.
func (c Cell) Mix() string {
	if c.Limit.Name == limitAllow.Name {
		return "allow-heavy"
	}
	return "deny-heavy"
}

// Result holds the figures of one cell for one contender.
type Result struct {
	Def  *Def
	Cell Cell
	Counts
	// Elapsed runs from the start of the timed loop to the last call that did not end abandoned:
	// the throughput's denominator. A caller asleep in a retry backoff when the window closes
	// wakes only to abandon its call (ErrStopped), which would otherwise stretch the cell (by up
	// to the 200 ms of InSerializableTx's longest backoff). Wall runs to the end of the last call,
	// abandoned or not, the span CPU covers.
	Elapsed, Wall time.Duration
	P50, P99      time.Duration
	// Trips counts round trips (Postgres statements or Redis commands); -1 when not applicable.
	Trips int64
	// WAL is the bytes of WAL Postgres wrote while the cell ran; -1 when not measured.
	WAL int64
	// CPU is the processor time the timed part of the cell used (cpu.go).
	CPU CPUUse

	hist histogram // the latencies P50 and P99 are read from
}

// Add adds o, the figures of another slice of the same contender in the same cell (Mode.Rounds),
// to r: counts, times, round trips, WAL and CPU add up, and the percentiles are those of both
// slices' latencies together. A figure not measured in either slice (-1, or CPU not OK) is not
// measured in the sum.
func (r *Result) Add(o *Result) {
	r.Counts.Add(o.Counts)
	r.Elapsed += o.Elapsed
	r.Wall += o.Wall
	sumMeasured := func(a, b int64) int64 {
		if a < 0 || b < 0 {
			return -1
		}
		return a + b
	}
	r.Trips = sumMeasured(r.Trips, o.Trips)
	r.WAL = sumMeasured(r.WAL, o.WAL)
	if r.CPU.OK && o.CPU.OK {
		r.CPU.Self += o.CPU.Self
		r.CPU.Idle += o.CPU.Idle
		if r.CPU.Server < 0 || o.CPU.Server < 0 {
			r.CPU.Server = -1
		} else {
			r.CPU.Server += o.CPU.Server
		}
	} else {
		r.CPU = CPUUse{}
	}
	r.hist.merge(&o.hist)
	r.P50, r.P99 = r.hist.quantile(0.50), r.hist.quantile(0.99)
}

// PerSecond is the throughput in decisions per second.
func (r *Result) PerSecond() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Decisions) / r.Elapsed.Seconds()
}

func (r *Result) perDecision(n int64) float64 {
	if r.Decisions == 0 {
		return math.NaN()
	}
	return float64(n) / float64(r.Decisions)
}

// RunOpts bound a cell.
type RunOpts struct {
	// Duration is how long callers keep issuing decisions after the warm-up.
	Duration time.Duration
	// MaxPerCaller bounds the decisions of each caller.
	MaxPerCaller int
	// Tag makes the cell's keys unique in the run.
	Tag string
	// WarmShards is the most shards of the contenders the cell is run for (warmUps); 0 or 1 when
	// none is sharded.
	WarmShards int
	// Again marks a later slice of the cell (Mode.Rounds): the first slice created its keys' rows,
	// so it warms up as if no contender were sharded (warmUps of 0 shards: each caller's
	// connection, and the deny-heavy bucket emptied again of what it refilled meanwhile).
	Again bool
}

// warmUps returns how many decisions each caller of the cell makes before the timed loop: one,
// which opens its connection and creates an unsharded key's row; when a contender of the cell is
// sharded (shards, the most of them), enough that the key's calls have decided 2·shards times
// (hot key: all callers together; per user: each caller on its own key), which creates nearly
// every shard's row (a missing shard counts full, so the calls charge it first). Without it the
// timed loop of a short cell on sharded keys measured mostly the creation of rows: in quick mode,
// 16 shards per user at 64 callers decided 2,232/s with 0.5 s cells and 8,679/s with 5 s cells
// (docs/design-history.md, 2026-11-27). On the deny-heavy limit the key's calls decide at least
// its burst (10) times, which empties a bucket that starts full, so that the timed loop is
// deny-heavy whichever contenders run (with one decision, a run of unsharded contenders alone
// started each key with 9 tokens, and at 64 callers per user a quick cell granted most of its
// decisions). Every contender of a cell makes as many, so that all start the timed loop with their
// buckets alike.
func warmUps(shards int, cell Cell) int {
	perKey := 1
	if shards >= 2 {
		perKey = 2 * shards
	}
	if cell.Mix() == "deny-heavy" {
		perKey = max(perKey, int(math.Ceil(cell.Limit.Burst)))
	}
	if cell.Scenario == HotKey {
		return max(1, (perKey+cell.Callers-1)/cell.Callers)
	}
	return perKey
}

// keysFor returns the key each caller uses.
func keysFor(cell Cell, tag string) []string {
	keys := make([]string, cell.Callers)
	for i := range keys {
		if cell.Scenario == HotKey {
			keys[i] = tag + "/hot"
		} else {
			keys[i] = fmt.Sprintf("%s/user-%d", tag, i)
		}
	}
	return keys
}

// RunCell measures one contender in one cell. A warm-up first creates the rows, prepares the
// statements and opens the connections (warmUps), then all callers decide in a loop until the
// duration or their count is up. Counters, WAL and CPU cover the timed loop only.
func RunCell(ctx context.Context, env *Env, def *Def, c Contender, cell Cell, opts RunOpts) *Result {
	res := &Result{Def: def, Cell: cell, Trips: -1, WAL: -1}
	keys := keysFor(cell, opts.Tag)
	ctx, cancel := context.WithTimeout(ctx, opts.Duration+time.Minute)
	defer cancel()

	var wg sync.WaitGroup
	for i := range keys {
		wg.Go(func() {
			shards := max(opts.WarmShards, def.Shards)
			if opts.Again {
				shards = 0
			}
			for range warmUps(shards, cell) {
				_, _ = c.Decide(ctx, cell.Limit.Name, keys[i])
			}
		})
	}
	wg.Wait()

	var lsn0 string
	if def.Family.OnPostgres() {
		if l, err := walLSN(ctx, env.Pool); err == nil {
			lsn0 = l
		}
	}
	trips := func() int64 {
		switch {
		case def.Family.OnPostgres():
			return env.PGTrips.Load()
		case def.Family == FamilyRedis:
			return env.RedisTrips.Load()
		}
		return 0
	}
	trips0 := trips()

	type tally struct {
		Counts
		h    histogram
		last time.Time // when the caller's last call that was not abandoned returned
	}
	tallies := make([]tally, len(keys))
	cpu0 := readCPU(env.ServerPIDs)
	start := time.Now()
	deadline := start.Add(opts.Duration)
	stopCtx := WithStop(ctx, deadline)
	for i := range keys {
		wg.Go(func() {
			t := &tallies[i]
			for n := 0; n < opts.MaxPerCaller && ctx.Err() == nil; n++ {
				t0 := time.Now()
				if !t0.Before(deadline) {
					return
				}
				d, err := c.Decide(stopCtx, cell.Limit.Name, keys[i])
				if t.record(d, err) {
					t.h.add(time.Since(t0))
				}
				if !errors.Is(err, ErrStopped) {
					t.last = time.Now()
				}
			}
		})
	}
	wg.Wait()
	res.Wall = time.Since(start)
	res.CPU = cpuSince(cpu0, env.ServerPIDs, serverOf(def.Family))
	res.Elapsed = res.Wall
	if last := lastReturn(tallies, func(t tally) time.Time { return t.last }); !last.IsZero() {
		res.Elapsed = last.Sub(start)
	}

	if def.Family.OnPostgres() || def.Family == FamilyRedis {
		res.Trips = trips() - trips0
	}
	if lsn0 != "" {
		if lsn1, err := walLSN(ctx, env.Pool); err == nil {
			if n, err := walDiff(ctx, env.Pool, lsn0, lsn1); err == nil {
				res.WAL = n
			}
		}
	}
	h := &res.hist
	for i := range tallies {
		res.Counts.Add(tallies[i].Counts)
		h.merge(&tallies[i].h)
	}
	res.P50, res.P99 = h.quantile(0.50), h.quantile(0.99)
	return res
}

// OverGrant is the outcome of the over-grant test (docs/spec.md §7) for one contender.
type OverGrant struct {
	Def *Def
	Counts
	Window          time.Duration // how long callers issued decisions
	Span            time.Duration // first to last grant's decision time, on the decider's clock
	Max             int64         // Burst + Rate·Span, rounded down
	Nominal         int64         // Burst + Rate·Window: 40 for the test's 3 s
	firstAt, lastAt time.Time
}

// OverGrantPct is (allowed - max)/max in percent: > 0 is over-grant, < 0 under-grant.
func (o *OverGrant) OverGrantPct() float64 {
	if o.Max == 0 {
		return math.NaN()
	}
	return 100 * float64(o.Allowed-o.Max) / float64(o.Max)
}

// RunOverGrant hammers one fresh key of limit with callers goroutines for window and counts grants.
// A bucket that starts full can grant at most Burst + Rate·t in the t from its first grant to its
// last, so the bound is taken over Span: the first to the last grant's decision time on the
// decider's own clock. Denials do not stretch it: one after the last grant adds nothing to what
// the bucket may have granted (with them, a limiter that granted one too many passed as long as it
// went on denying for 1/Rate). Callers stop issuing at window; a decision still in flight then
// (e.g. in a serialization-retry backoff) counts, and a grant among them can make Span a little
// longer than window, and Max then says so.
func RunOverGrant(ctx context.Context, c Contender, def *Def, limit Limit, key string, callers int, window time.Duration) *OverGrant {
	ctx, cancel := context.WithTimeout(ctx, window+time.Minute)
	defer cancel()
	type tally struct {
		Counts
		first, last time.Time
	}
	tallies := make([]tally, callers)
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(window)
	ctx = WithStop(ctx, deadline)
	for i := range tallies {
		wg.Go(func() {
			t := &tallies[i]
			for n := 0; n < 50_000_000 && ctx.Err() == nil && time.Now().Before(deadline); n++ {
				d, err := c.Decide(ctx, limit.Name, key)
				if !t.record(d, err) || !d.Allowed {
					continue
				}
				if t.first.IsZero() || d.At.Before(t.first) {
					t.first = d.At
				}
				if d.At.After(t.last) {
					t.last = d.At
				}
			}
		})
	}
	wg.Wait()
	o := &OverGrant{Def: def, Window: window}
	for i := range tallies {
		t := &tallies[i]
		o.Counts.Add(t.Counts)
		if !t.first.IsZero() && (o.firstAt.IsZero() || t.first.Before(o.firstAt)) {
			o.firstAt = t.first
		}
		if t.last.After(o.lastAt) {
			o.lastAt = t.last
		}
	}
	if !o.firstAt.IsZero() {
		o.Span = o.lastAt.Sub(o.firstAt)
	}
	// The small epsilon absorbs float rounding in Rate·Span; it never adds a whole token.
	o.Max = int64(math.Floor(limit.Burst + limit.PerSecond()*o.Span.Seconds() + 1e-9))
	o.Nominal = int64(math.Floor(limit.Burst + limit.PerSecond()*window.Seconds() + 1e-9))
	return o
}

// histogram records durations in buckets 1/32 of a power of two wide (about 3% precision).
type histogram struct {
	counts [40 * 32]uint64
	n      uint64
}

func bucketOf(ns uint64) int {
	if ns < 64 {
		return int(ns)
	}
	e := bits.Len64(ns) - 6 // ns>>e is in [32, 64)
	return (e+1)*32 + int(ns>>e) - 32
}

func bucketMid(i int) uint64 {
	if i < 64 {
		return uint64(i)
	}
	e := i/32 - 1
	lo := uint64(i%32+32) << e
	return lo + (uint64(1)<<e)/2
}

func (h *histogram) add(d time.Duration) {
	i := bucketOf(uint64(max(d, 0)))
	if i >= len(h.counts) {
		i = len(h.counts) - 1
	}
	h.counts[i]++
	h.n++
}

func (h *histogram) merge(o *histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
}

func (h *histogram) quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank && c > 0 {
			return time.Duration(bucketMid(i))
		}
	}
	return 0
}

// lastReturn is the latest of the callers' last returns (zero when none returned).
func lastReturn[T any](ts []T, last func(T) time.Time) time.Time {
	var m time.Time
	for _, t := range ts {
		if l := last(t); l.After(m) {
			m = l
		}
	}
	return m
}

// Counts tallies decisions: one caller's, or a measurement's (Result, OverGrant).
type Counts struct {
	// Decisions counts the decisions that returned (granted or denied); Errors those that failed.
	Decisions, Allowed, Errors, Retries int64
	// Abandoned counts decisions given up between two attempts when the window closed.
	Abandoned int64
	FirstErr  error
}

// record counts one call's outcome and reports whether it was a decision (granted or denied), as
// opposed to an error or a call abandoned at the window's end.
func (t *Counts) record(d Decision, err error) bool {
	if errors.Is(err, ErrStopped) {
		t.Abandoned++
		return false
	}
	if err != nil {
		t.Errors++
		if t.FirstErr == nil {
			t.FirstErr = err
		}
		return false
	}
	t.Retries += int64(d.Retries) // per decision: an error's or an abandoned call's attempts are not counted
	t.Decisions++
	if d.Allowed {
		t.Allowed++
	}
	return true
}

// Add adds o, another caller's or another slice's counts, to t's; t's first error stays when it
// has one.
func (t *Counts) Add(o Counts) {
	t.Decisions += o.Decisions
	t.Allowed += o.Allowed
	t.Errors += o.Errors
	t.Retries += o.Retries
	t.Abandoned += o.Abandoned
	if t.FirstErr == nil {
		t.FirstErr = o.FirstErr
	}
}
