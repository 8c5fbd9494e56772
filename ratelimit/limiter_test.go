package ratelimit_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/pgbouncertest"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// Symbolic times, x/time/rate style. t0 is a round instant so fixed windows anchored at it are easy
// to read.
var (
	t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	ms = time.Millisecond
)

// testClock is an injectable clock (LimiterConfig.Now).
type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *testClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

func (c *testClock) Set(t time.Time) { c.mu.Lock(); defer c.mu.Unlock(); c.t = t }

// testBundle is what a test decides with: its context, pool, limiter and, when the test moves the
// limiter's clock, that clock.
type testBundle struct {
	ctx   context.Context
	pool  *pgxpool.Pool
	clock *testClock // nil: the database's clock
	lim   *ratelimit.Limiter
}

// setup returns a limiter on a fresh schema whose clock is t0 until the test moves it.
func setup(t *testing.T, limits map[string]ratelimit.Config) *testBundle {
	t.Helper()
	clock := &testClock{t: t0}
	b := newBundle(t, nil, &ratelimit.LimiterConfig{Limits: limits, Now: clock.Now})
	b.clock = clock
	return b
}

// setupDB returns a limiter on the database's clock (b.clock is nil) and a fresh schema reached by
// a pool of opts (nil: testdb's defaults), for the tests that run in real time.
func setupDB(t *testing.T, opts *testdb.Options, limits map[string]ratelimit.Config) *testBundle {
	t.Helper()
	return newBundle(t, opts, &ratelimit.LimiterConfig{Limits: limits})
}

// newBundle returns the limiter of cfg and a fresh schema reached by a pool of opts.
func newBundle(t *testing.T, opts *testdb.Options, cfg *ratelimit.LimiterConfig) *testBundle {
	t.Helper()
	lim, err := ratelimit.New(cfg)
	require.NoError(t, err)
	return &testBundle{ctx: context.Background(), pool: testdb.Pool(t, opts), lim: lim}
}

// step is one call in a table-driven sequence.
type step struct {
	at       time.Time
	count    float64
	reserve  bool
	check    bool // CheckN instead of LimitN
	ok       bool
	reserved bool
	retryAt  time.Time // zero when no wait
	value    float64
}

func runSteps(t *testing.T, b *testBundle, name, key string, steps []step) {
	t.Helper()
	for i, s := range steps {
		b.clock.Set(s.at)
		opts := &ratelimit.LimitOpts{Reserve: s.reserve}
		var res ratelimit.Result
		var err error
		if s.check {
			res, err = b.lim.CheckN(b.ctx, b.pool, name, key, s.count, opts)
		} else {
			res, err = b.lim.LimitN(b.ctx, b.pool, name, key, s.count, opts)
		}
		require.NoError(t, err, "step %d", i)
		if res.OK != s.ok || res.Reserved != s.reserved || !res.RetryAt.Equal(s.retryAt) || res.Value != s.value {
			t.Fatalf("step %d at t0+%v: LimitN(%g, reserve=%v) = ok %v reserved %v retryAt t0+%v value %v; want ok %v reserved %v retryAt t0+%v value %v",
				i, s.at.Sub(t0), s.count, s.reserve, res.OK, res.Reserved, sinceT0(res.RetryAt), res.Value,
				s.ok, s.reserved, sinceT0(s.retryAt), s.value)
		}
		require.True(t, res.Time.Equal(s.at), "step %d: decision time %v, want the injected %v", i, res.Time, s.at)
	}
}

func sinceT0(t time.Time) any {
	if t.IsZero() {
		return "∅"
	}
	return t.Sub(t0)
}

// docs/spec.md §3: v = min(value + (now−ts)·r, cap) − count; RetryAt = ts' + (−v)/r.
func TestTokenBucketRefillWithCap(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"tb": {Rate: 10, Period: time.Second, MaxReserved: ratelimit.Unbounded}})
	runSteps(t, b, "tb", "u1", []step{
		{at: t0, count: 4, ok: true, value: 6},                                                       // a missing row is full: 10 − 4
		{at: t0.Add(100 * ms), count: 7, ok: true, value: 0},                                         // 6 + 0.1 s·10/s = 7, all taken
		{at: t0.Add(100 * ms), count: 1, retryAt: t0.Add(200 * ms), value: 0},                        // denied: 1 token accrues in 100 ms
		{at: t0.Add(150 * ms), count: 1, retryAt: t0.Add(200 * ms), value: 0.5},                      // denied, nothing written: 0.5 held
		{at: t0.Add(200 * ms), count: 1, ok: true, value: 0},                                         // exactly at RetryAt: granted
		{at: t0.Add(time.Hour), count: 1, check: true, ok: true, value: 9},                           // refill capped at 10; Check writes nothing
		{at: t0.Add(time.Hour), count: 10, ok: true, value: 0},                                       // so the full 10 are still there
		{at: t0.Add(time.Hour + 250*ms), count: 2.5, ok: true, value: 0},                             // partial refill, fractional count
		{at: t0.Add(time.Hour + 250*ms), count: 0.25, retryAt: t0.Add(time.Hour + 275*ms), value: 0}, // 0.25 in 25 ms
	})
}

// Capacity above Rate is a burst: a 10/min bucket with capacity 20 starts with 20.
func TestTokenBucketCapacity(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"burst": {Rate: 10, Period: time.Minute, Capacity: 20}})
	runSteps(t, b, "burst", "", []step{
		{at: t0, count: 20, ok: true, value: 0},
		{at: t0.Add(6 * time.Second), count: 1, ok: true, value: 0}, // 1 per 6 s
		{at: t0.Add(9 * time.Second), count: 1, retryAt: t0.Add(12 * time.Second), value: 0.5},
		{at: t0.Add(24 * time.Hour), count: 20, ok: true, value: 0}, // idle: back to capacity, not beyond
		{at: t0.Add(24 * time.Hour), count: 20, check: true, retryAt: t0.Add(24*time.Hour + 2*time.Minute), value: 0},
	})
}

// docs/spec.md §2: a request evaluated at now < ts is evaluated at ts; the row never moves back.
func TestClockNeverRunsBackwards(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"tb": {Rate: 10, Period: time.Second, MaxReserved: ratelimit.Unbounded}})
	runSteps(t, b, "tb", "k", []step{
		{at: t0.Add(time.Second), count: 10, ok: true, value: 0},
		// A skewed caller at t0 (one second earlier) sees no refill and no negative refill.
		{at: t0, count: 1, retryAt: t0.Add(time.Second + 100*ms), value: 0},
		{at: t0.Add(500 * ms), count: 1, retryAt: t0.Add(time.Second + 100*ms), value: 0},
		{at: t0.Add(time.Second + 100*ms), count: 1, ok: true, value: 0},
		// A reservation from the past is timed from the row's ts, not from the caller's clock.
		{at: t0, count: 2, reserve: true, ok: true, reserved: true, retryAt: t0.Add(time.Second + 300*ms), value: -2},
	})
	st, err := b.lim.State(b.ctx, b.pool, "tb", "k", nil)
	require.NoError(t, err)
	require.True(t, st.TS.Equal(t0.Add(time.Second+100*ms)), "ts moved to %v", st.TS)

	// Fixed window: the window never moves back either.
	b2 := setup(t, map[string]ratelimit.Config{"fw": {Kind: ratelimit.FixedWindow, Rate: 3, Period: time.Minute, Start: t0}})
	runSteps(t, b2, "fw", "k", []step{
		{at: t0.Add(2 * time.Minute), count: 3, ok: true, value: 0},
		{at: t0.Add(30 * time.Second), count: 1, retryAt: t0.Add(3 * time.Minute), value: 0},
	})
}

// docs/spec.md §4: n = floor((now − ts)/Period), v = min(value + Rate·n, cap) − count,
// RetryAt = ts' + Period·ceil(−v/Rate).
func TestFixedWindowRollover(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{
		"fw":  {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, Start: t0},
		"fw8": {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, Capacity: 8, Start: t0},
	})
	runSteps(t, b, "fw", "k", []step{
		{at: t0.Add(10 * time.Second), count: 5, ok: true, value: 0},
		{at: t0.Add(10 * time.Second), count: 1, retryAt: t0.Add(time.Minute), value: 0}, // the window's end
		{at: t0.Add(time.Minute - time.Microsecond), count: 1, retryAt: t0.Add(time.Minute), value: 0},
		{at: t0.Add(time.Minute), count: 1, ok: true, value: 4}, // a new window: 5 tokens, no more
		{at: t0.Add(time.Minute + 59*time.Second), count: 4, ok: true, value: 0},
		{at: t0.Add(10 * time.Minute), count: 5, ok: true, value: 0}, // capped at Rate (capacity defaults to rate)
		{at: t0.Add(10 * time.Minute), count: 5, check: true, retryAt: t0.Add(11 * time.Minute), value: 0},
	})
	runSteps(t, b, "fw8", "k", []step{
		{at: t0, count: 8, ok: true, value: 0},
		{at: t0.Add(time.Minute), count: 5, ok: true, value: 0},     // one window adds Rate = 5
		{at: t0.Add(3 * time.Minute), count: 8, ok: true, value: 0}, // two windows: min(0 + 10, 8)
		{at: t0.Add(3 * time.Minute), count: 7, check: true, retryAt: t0.Add(5 * time.Minute), value: 0},
	})
}

// Without Start, the grid's phase comes from a hash of (name, key): spread across keys, the same
// every time for one key.
func TestFixedWindowDerivedPhase(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"fw": {Kind: ratelimit.FixedWindow, Rate: 1, Period: time.Hour}})
	ends := map[time.Time]bool{}
	for _, key := range []string{"a", "b", "c", "d", "e", "f"} {
		res, err := b.lim.Limit(b.ctx, b.pool, "fw", key, nil)
		require.NoError(t, err)
		require.True(t, res.OK)
		res, err = b.lim.Limit(b.ctx, b.pool, "fw", key, nil)
		require.NoError(t, err)
		require.False(t, res.OK)
		require.True(t, res.RetryAt.After(t0) && !res.RetryAt.After(t0.Add(time.Hour)), "window end %v outside (t0, t0+1h]", res.RetryAt)
		ends[res.RetryAt] = true
		// Reset and do it again: the phase is stable.
		require.NoError(t, b.lim.Reset(b.ctx, b.pool, "fw", key))
		_, err = b.lim.Limit(b.ctx, b.pool, "fw", key, nil)
		require.NoError(t, err)
		again, err := b.lim.Limit(b.ctx, b.pool, "fw", key, nil)
		require.NoError(t, err)
		require.Equal(t, res.RetryAt, again.RetryAt, "key %q: phase changed across a reset", key)
	}
	require.Greater(t, len(ends), 3, "six keys share %d window ends: phases are not spread", len(ends))
}

// docs/spec.md §4: without Start the grid's anchor is the 64-bit FNV-1a hash of name, a NUL byte
// and key, modulo Period, after the Unix epoch, the same for every shard of the key; a missing row is
// full, at the start of the window holding now.
func TestFixedWindowHashedPhaseExact(t *testing.T) {
	t.Parallel()
	const period = time.Hour
	b := setup(t, map[string]ratelimit.Config{
		"fw":  {Kind: ratelimit.FixedWindow, Rate: 1, Period: period},
		"fws": {Kind: ratelimit.FixedWindow, Rate: 2, Period: period, Shards: 2}, // 1 per shard
	})
	window := func(name, key string) (start, end time.Time) {
		p := period.Microseconds()
		phase := int64(fnv1a([]byte(name), []byte{0}, []byte(key)) % uint64(p))
		s := phase + (t0.UnixMicro()-phase)/p*p // t0 is after the phase: no negative division
		return time.UnixMicro(s).UTC(), time.UnixMicro(s + p).UTC()
	}
	picks := [][2]int{{0, 1}, {1, 0}, {0, 1}}
	ratelimit.SetShardPicker(b.lim, func(int) (int, int) { p := picks[0]; picks = picks[1:]; return p[0], p[1] })
	for _, c := range []struct {
		name  string
		calls int // granted before the denial: the capacity
	}{{"fw", 1}, {"fws", 2}} {
		start, end := window(c.name, "k")
		for i := range c.calls + 1 {
			r, err := b.lim.Limit(b.ctx, b.pool, c.name, "k", nil)
			require.NoError(t, err)
			if granted := i < c.calls; r.OK != granted || (!granted && !r.RetryAt.Equal(end)) {
				t.Fatalf("%s: call %d: ok %v retryAt %v; want ok %v, a denial until the window's end %v", c.name, i, r.OK, r.RetryAt, granted, end)
			}
		}
		st, err := b.lim.State(b.ctx, b.pool, c.name, "k", nil)
		require.NoError(t, err)
		require.True(t, st.TS.Equal(start), "%s: rows stamped %v, want the window's start %v", c.name, st.TS, start)
		require.Equal(t, make([]float64, c.calls), st.Shards, c.name)
	}
}

// docs/spec.md §4: a row written under another Start keeps counting windows from its own ts until
// Reset removes it; then the key is full, at the start of the new grid's window holding now.
func TestFixedWindowRowKeepsItsGridUntilReset(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"fw": {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, Start: t0}})
	moved := &ratelimit.LimitOpts{Config: &ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, Start: t0.Add(30 * time.Second)}}
	limit := func(at time.Time, count float64) ratelimit.Result {
		t.Helper()
		b.clock.Set(at)
		r, err := b.lim.LimitN(b.ctx, b.pool, "fw", "k", count, moved)
		require.NoError(t, err)
		return r
	}
	b.clock.Set(t0.Add(10 * time.Second))
	r, err := b.lim.LimitN(b.ctx, b.pool, "fw", "k", 5, nil) // the row (0, t0)
	require.NoError(t, err)
	require.True(t, r.OK)
	// The new grid started a window at t0 + 30 s, but the row counts from t0: its next is t0 + 1m.
	r = limit(t0.Add(50*time.Second), 1)
	require.False(t, r.OK)
	require.Equal(t, t0.Add(time.Minute), r.RetryAt, "RetryAt t0+%v", sinceT0(r.RetryAt))
	require.NoError(t, b.lim.Reset(b.ctx, b.pool, "fw", "k"))
	r = limit(t0.Add(50*time.Second), 5) // missing: full, in the window [t0 + 30 s, t0 + 90 s)
	require.True(t, r.OK)
	require.Equal(t, t0.Add(30*time.Second), r.TS, "TS t0+%v", sinceT0(r.TS))
	r = limit(t0.Add(50*time.Second), 1)
	require.Equal(t, t0.Add(90*time.Second), r.RetryAt, "RetryAt t0+%v", sinceT0(r.RetryAt))
}

// docs/spec.md §4: without reservations, at most cap tokens within one window.
func TestFixedWindowAtMostCapacityPerWindow(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"fw": {Kind: ratelimit.FixedWindow, Rate: 4, Period: time.Second, Capacity: 6, Start: t0}})
	granted := 0.0
	for at := t0.Add(5 * time.Second); at.Before(t0.Add(6 * time.Second)); at = at.Add(50 * ms) {
		b.clock.Set(at)
		res, err := b.lim.Limit(b.ctx, b.pool, "fw", "k", nil)
		require.NoError(t, err)
		if res.OK {
			granted++
		}
	}
	require.Equal(t, 6.0, granted, "one window granted %v, want capacity 6", granted)
}

// docs/spec.md §3 with Reserve: granted below zero while −v ≤ MaxReserved; RetryAt is when the debt
// is paid, and for a reservation refused over MaxReserved, when the same reservation fits.
func TestReservations(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{
		"bounded":   {Rate: 10, Period: time.Second, MaxReserved: 5},
		"unbounded": {Rate: 10, Period: time.Second, MaxReserved: ratelimit.Unbounded},
		"fw":        {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, MaxReserved: 12, Start: t0},
	})
	runSteps(t, b, "bounded", "k", []step{
		{at: t0, count: 10, ok: true, value: 0},
		{at: t0, count: 3, reserve: true, ok: true, reserved: true, retryAt: t0.Add(300 * ms), value: -3},
		{at: t0, count: 3, reserve: true, retryAt: t0.Add(100 * ms), value: -3},                                      // −6 > 5: denied, nothing written; −2 − 3 fits
		{at: t0.Add(100*ms - time.Microsecond), count: 3, reserve: true, retryAt: t0.Add(100 * ms), value: -2.00001}, // one µs early: still refused
		{at: t0, count: 3, reserve: true, retryAt: t0.Add(100 * ms), value: -3},
		{at: t0, count: 2, reserve: true, ok: true, reserved: true, retryAt: t0.Add(500 * ms), value: -5}, // −5 ≤ 5
		{at: t0, count: 0.001, reserve: true, retryAt: t0.Add(100 * time.Microsecond), value: -5},         // fits at −4.999
		{at: t0.Add(100 * ms), count: 1, reserve: true, ok: true, reserved: true, retryAt: t0.Add(600 * ms), value: -5},
		{at: t0.Add(600 * ms), count: 1, retryAt: t0.Add(700 * ms), value: 0}, // paid off, but nothing spare
		{at: t0.Add(700 * ms), count: 1, ok: true, value: 0},
	})
	runSteps(t, b, "unbounded", "k", []step{
		{at: t0, count: 1000, reserve: true, ok: true, reserved: true, retryAt: t0.Add(99 * time.Second), value: -990},
		{at: t0, count: 1, retryAt: t0.Add(99*time.Second + 100*ms), value: -990}, // no Reserve: denied
	})
	runSteps(t, b, "fw", "k", []step{
		// The window started at t0 with 5 tokens; 17 = cap + MaxReserved is the most one call can book.
		{at: t0.Add(time.Second), count: 17, reserve: true, ok: true, reserved: true, retryAt: t0.Add(3 * time.Minute), value: -12}, // ceil(12/5) windows
		{at: t0.Add(time.Second), count: 1, reserve: true, retryAt: t0.Add(time.Minute), value: -12},                                // −13 > 12: denied; the next window's −7 − 1 fits
		{at: t0.Add(2 * time.Minute), count: 1, retryAt: t0.Add(3 * time.Minute), value: -2},                                        // two windows: −12 + 10
		{at: t0.Add(3 * time.Minute), count: 3, ok: true, value: 0},
	})
}

// Limit and Check agree, and Check writes nothing.
func TestCheckMatchesLimitAndWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"tb": {Rate: 3, Period: time.Second}})
	for i := 0; i < 5; i++ {
		c, err := b.lim.Check(b.ctx, b.pool, "tb", "k", nil)
		require.NoError(t, err)
		c2, err := b.lim.Check(b.ctx, b.pool, "tb", "k", nil)
		require.NoError(t, err)
		require.Equal(t, c, c2, "step %d: Check changed state", i)
		l, err := b.lim.Limit(b.ctx, b.pool, "tb", "k", nil)
		require.NoError(t, err)
		require.Equal(t, c, l, "step %d: Check and Limit disagree", i)
	}
}

func TestValueResetCredit(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"tb": {Rate: 10, Period: time.Second, Capacity: 20, MaxReserved: ratelimit.Unbounded}})
	st, err := b.lim.State(b.ctx, b.pool, "tb", "k", nil)
	require.NoError(t, err)
	require.Equal(t, 20.0, st.Value, "a missing row is full")
	require.True(t, st.TS.IsZero())

	_, err = b.lim.LimitN(b.ctx, b.pool, "tb", "k", 15, nil)
	require.NoError(t, err)
	b.clock.Set(t0.Add(200 * ms))
	st, err = b.lim.State(b.ctx, b.pool, "tb", "k", nil)
	require.NoError(t, err)
	require.Equal(t, 7.0, st.Value) // 5 + 0.2 s·10/s
	require.True(t, st.TS.Equal(t0))
	require.Equal(t, "tb", st.Name)

	c, err := b.lim.Credit(b.ctx, b.pool, "tb", "k", 4, nil)
	require.NoError(t, err)
	require.Equal(t, ratelimit.CreditResult{Name: "tb", Key: "k", Credited: 4, Value: 11, Time: t0.Add(200 * ms)}, c)
	c, err = b.lim.Credit(b.ctx, b.pool, "tb", "k", 100, nil)
	require.NoError(t, err)
	require.Equal(t, 9.0, c.Credited, "credit is capped at capacity")
	require.Equal(t, 20.0, c.Value)

	// Credit settles a reservation: reserve 30, actual use 12, give back 18.
	_, err = b.lim.LimitN(b.ctx, b.pool, "tb", "k", 30, &ratelimit.LimitOpts{Reserve: true})
	require.NoError(t, err)
	c, err = b.lim.Credit(b.ctx, b.pool, "tb", "k", 18, nil)
	require.NoError(t, err)
	require.Equal(t, 8.0, c.Value) // 20 − 12

	// A credit on a missing row changes nothing and creates nothing.
	c, err = b.lim.Credit(b.ctx, b.pool, "tb", "other", 5, nil)
	require.NoError(t, err)
	require.Equal(t, ratelimit.CreditResult{Name: "tb", Key: "other", Credited: 0, Value: 20, Time: t0.Add(200 * ms)}, c)

	require.NoError(t, b.lim.Reset(b.ctx, b.pool, "tb", "k"))
	st, err = b.lim.State(b.ctx, b.pool, "tb", "k", nil)
	require.NoError(t, err)
	require.Equal(t, 20.0, st.Value)
	require.True(t, st.TS.IsZero(), "reset removed the row")
	require.NoError(t, b.lim.Reset(b.ctx, b.pool, "tb", "never-used"), "resetting a missing row is fine")
}

func TestInlineConfigAndUnknownName(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"known": {Rate: 1, Period: time.Second}})
	_, err := b.lim.Limit(b.ctx, b.pool, "unknown", "k", nil)
	var unk *ratelimit.UnknownLimitError
	require.ErrorAs(t, err, &unk)
	require.Equal(t, "unknown", unk.Name)
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
	require.Contains(t, err.Error(), `"unknown"`)

	inline := ratelimit.Config{Rate: 2, Period: time.Minute}
	for i, want := range []bool{true, true, false} {
		res, err := b.lim.Limit(b.ctx, b.pool, "unknown", "k", &ratelimit.LimitOpts{Config: &inline})
		require.NoError(t, err)
		require.Equal(t, want, res.OK, "step %d", i)
	}
	// An inline config overrides the registered one.
	res, err := b.lim.LimitN(b.ctx, b.pool, "known", "k", 5, &ratelimit.LimitOpts{Config: &ratelimit.Config{Rate: 5, Period: time.Second}})
	require.NoError(t, err)
	require.True(t, res.OK)
}

// docs/spec.md §6 (denials as errors): a denial becomes a typed error; a reservation never does.
func TestAsError(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"tb": {Rate: 1, Period: time.Second, MaxReserved: ratelimit.Unbounded}})
	throw := &ratelimit.LimitOpts{AsError: true}
	_, err := b.lim.Limit(b.ctx, b.pool, "tb", "k", throw)
	require.NoError(t, err)
	res, err := b.lim.Limit(b.ctx, b.pool, "tb", "k", &ratelimit.LimitOpts{AsError: true, Reserve: true})
	require.NoError(t, err, "a granted reservation is not an error")
	require.True(t, res.Reserved)
	res, err = b.lim.Limit(b.ctx, b.pool, "tb", "k", throw)
	var le *ratelimit.LimitedError
	require.ErrorAs(t, err, &le)
	require.Equal(t, "tb", le.Name)
	require.Equal(t, "k", le.Key)
	require.True(t, le.RetryAt.Equal(t0.Add(2*time.Second)), "retry at %v", le.RetryAt)
	require.True(t, ratelimit.IsLimited(err))
	require.False(t, res.OK)
	require.Equal(t, time.Duration(2*time.Second), res.RetryAfter())
}

func TestLimitMany(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{
		"perUser": {Rate: 3, Period: time.Second},
		"global":  {Rate: 100, Period: time.Second},
		"daily":   {Kind: ratelimit.FixedWindow, Rate: 4, Period: 24 * time.Hour, Start: t0},
	})
	reqs := []ratelimit.Request{{Name: "perUser", Key: "u1"}, {Name: "global"}, {Name: "daily", Key: "u1"}}
	for i := 0; i < 3; i++ {
		m, err := b.lim.LimitMany(b.ctx, b.pool, reqs, nil)
		require.NoError(t, err)
		require.True(t, m.OK, "step %d", i)
		require.True(t, m.RetryAt.IsZero())
	}
	// perUser is empty: the whole call is denied and nothing is consumed, daily included.
	m, err := b.lim.LimitMany(b.ctx, b.pool, reqs, nil)
	require.NoError(t, err)
	require.False(t, m.OK)
	require.Len(t, m.Denied(), 1)
	require.Equal(t, "perUser", m.Denied()[0].Name)
	require.True(t, m.RetryAt.Equal(t0.Add(333334*time.Microsecond)), "retry at %v", sinceT0(m.RetryAt)) // ceil(1e6/3) µs
	for _, r := range m.Results {
		require.Empty(t, r.Shards, "%s: nothing charged", r.Name)
	}
	st, err := b.lim.State(b.ctx, b.pool, "daily", "u1", nil)
	require.NoError(t, err)
	require.Equal(t, 1.0, st.Value, "daily kept its token")
	st, err = b.lim.State(b.ctx, b.pool, "global", "", nil)
	require.NoError(t, err)
	require.Equal(t, 97.0, st.Value)

	// One denial among three requests: the error names it and its RetryAt.
	b.clock.Set(t0.Add(time.Second))
	m, err = b.lim.LimitMany(b.ctx, b.pool, []ratelimit.Request{
		{Name: "perUser", Key: "u1", Count: 3}, {Name: "daily", Key: "u1", Count: 2}, {Name: "global"},
	}, &ratelimit.LimitOpts{AsError: true})
	var le *ratelimit.LimitedError
	require.ErrorAs(t, err, &le)
	require.False(t, m.OK)
	require.Len(t, le.Denied, 1, "perUser refilled to 3 by t0+1s; only daily is denied")
	require.Equal(t, "daily", le.Name)
	require.True(t, le.RetryAt.Equal(t0.Add(24*time.Hour)), "retry at %v", sinceT0(le.RetryAt))

	m, err = b.lim.CheckMany(b.ctx, b.pool, []ratelimit.Request{{Name: "perUser", Key: "u1", Count: 3}, {Name: "global", Count: 97}}, nil)
	require.NoError(t, err)
	require.True(t, m.OK)

	_, err = b.lim.LimitMany(b.ctx, b.pool, []ratelimit.Request{{Name: "global"}, {Name: "global"}}, nil)
	require.ErrorIs(t, err, ratelimit.ErrInvalid, "the same limit twice")
}

// CheckMany answers what LimitMany would (its doc), result for result, with one difference its
// doc states: in a denied call, a request that alone would be granted keeps the Shards (and TS)
// it would take alone, where LimitMany, having charged nothing, reports none.
func TestCheckManyAnswersWhatLimitManyWould(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{
		"perUser": {Rate: 3, Period: time.Second},
		"daily":   {Kind: ratelimit.FixedWindow, Rate: 4, Period: 24 * time.Hour, Start: t0},
		"sharded": {Rate: 20, Period: time.Second, Shards: 2},
	})
	ratelimit.SetShardPicker(b.lim, func(int) (int, int) { return 1, 0 }) // the same picks for both calls
	_, err := b.lim.LimitN(b.ctx, b.pool, "perUser", "u1", 3, nil)
	require.NoError(t, err)
	b.clock.Set(t0.Add(time.Hour))
	for _, reqs := range [][]ratelimit.Request{
		{{Name: "daily", Key: "u1", Count: 2}, {Name: "sharded", Key: "u1", Count: 3}},                                // granted
		{{Name: "daily", Key: "u1", Count: 3}, {Name: "sharded", Key: "u1", Count: 3}},                                // daily denied
		{{Name: "perUser", Key: "u1", Count: 3}, {Name: "daily", Key: "u1"}, {Name: "sharded"}},                       // perUser refilled
		{{Name: "perUser", Key: "u2", Count: 2.5}, {Name: "daily", Key: "u1", Count: 3}, {Name: "sharded", Count: 1}}, // denied
	} {
		check, err := b.lim.CheckMany(b.ctx, b.pool, reqs, nil)
		require.NoError(t, err)
		limit, err := b.lim.LimitMany(b.ctx, b.pool, reqs, nil)
		require.NoError(t, err)
		if !check.OK {
			for i := range check.Results {
				r := &check.Results[i]
				require.Equal(t, r.OK, len(r.Shards) > 0, "%s: Shards %v", r.Name, r.Shards)
				r.Shards, r.TS = nil, time.Time{}
			}
		}
		require.Equal(t, limit, check, "CheckMany and LimitMany answer %v differently", reqs)
	}
}

// InSerializableTx gives up with an error that says so and wraps the cause.
func TestInSerializableTxExhaustion(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, nil)
	attempts := 0
	cause := &pgconn.PgError{Code: "40001", Message: "could not serialize access"}
	err := ratelimit.InSerializableTx(context.Background(), pool, &ratelimit.TxOpts{MaxAttempts: 3, MinBackoff: time.Millisecond},
		func(ctx context.Context, _ pgx.Tx) error { attempts++; return cause })
	var ex *ratelimit.RetriesExhaustedError
	require.ErrorAs(t, err, &ex)
	require.Equal(t, 3, attempts)
	require.Equal(t, 3, ex.Attempts)
	require.ErrorIs(t, err, cause)
	require.Contains(t, err.Error(), "gave up after 3 attempts")

	other := errors.New("boom")
	attempts = 0
	err = ratelimit.InSerializableTx(context.Background(), pool, nil, func(ctx context.Context, _ pgx.Tx) error { attempts++; return other })
	require.ErrorIs(t, err, other)
	require.Equal(t, 1, attempts, "a non-retryable error is returned at once")
}

// A *BusyError's rerun costs no attempt, but it is a run: when InSerializableTx gives up, Attempts
// and the message say how many times the transaction ran, waits for busy shards included (before,
// "gave up after 2 attempts" after 102 runs). The waits (WaitForShard) run in pgx's default exec
// mode and in each mode docs/deploy.md calls safe behind a transaction pooler.
func TestInSerializableTxExhaustionCountsBusyReruns(t *testing.T) {
	t.Parallel()
	for _, m := range pgbouncertest.WithDefault() {
		t.Run(m.Name, func(t *testing.T) {
			t.Parallel()
			pool := testdb.Pool(t, &testdb.Options{MaxConns: 2, QueryExecMode: m.Mode})
			runs := 0
			busy := &ratelimit.BusyError{Name: "s", Key: "k", Candidates: 2} // no shard is held: each wait ends at once
			err := ratelimit.InSerializableTx(context.Background(), pool, &ratelimit.TxOpts{MaxAttempts: 2, MinBackoff: time.Microsecond},
				func(ctx context.Context, _ pgx.Tx) error { runs++; return busy })
			var ex *ratelimit.RetriesExhaustedError
			require.ErrorAs(t, err, &ex)
			require.ErrorIs(t, err, busy)
			require.Equal(t, 102, runs, "2 attempts and 100 reruns after a busy shard's wait")
			require.Equal(t, runs, ex.Attempts)
			require.Contains(t, err.Error(), fmt.Sprintf("gave up after %d attempts", runs))
		})
	}
}

// A nil db or fn is refused before any transaction begins, and a panicking fn does not leave its
// connection stuck in a transaction: on a one-connection pool the next call still gets through.
func TestInSerializableTxInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, &testdb.Options{MaxConns: 1})
	fn := func(context.Context, pgx.Tx) error { return nil }
	var nilPool *pgxpool.Pool
	for what, err := range map[string]error{
		"nil db":       ratelimit.InSerializableTx(ctx, nil, nil, fn),
		"typed nil db": ratelimit.InSerializableTx(ctx, nilPool, nil, fn),
		"nil fn":       ratelimit.InSerializableTx(ctx, pool, nil, nil),
	} {
		var argErr *ratelimit.ArgumentError
		require.ErrorAs(t, err, &argErr, what)
		require.ErrorIs(t, err, ratelimit.ErrInvalid, what)
	}
	// A negative TxOpts field is refused too, naming it, and fn never runs.
	for field, opts := range map[string]*ratelimit.TxOpts{
		"MaxAttempts": {MaxAttempts: -1}, "MinBackoff": {MinBackoff: -time.Millisecond}, "MaxBackoff": {MaxBackoff: -1},
	} {
		err := ratelimit.InSerializableTx(ctx, pool, opts, func(context.Context, pgx.Tx) error {
			t.Errorf("%s: fn ran", field)
			return nil
		})
		var argErr *ratelimit.ArgumentError
		require.ErrorAs(t, err, &argErr, field)
		require.Equal(t, "opts", argErr.Arg, field)
		require.Contains(t, argErr.Reason, field)
	}

	require.PanicsWithValue(t, "boom", func() {
		_ = ratelimit.InSerializableTx(ctx, pool, nil, func(context.Context, pgx.Tx) error { panic("boom") })
	})
	quick, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	require.NoError(t, ratelimit.InSerializableTx(quick, pool, nil, fn), "the connection was given back")
}

// docs/spec.md §3: without reservations a token bucket grants at most cap + Rate tokens in any
// interval of length Period, and reaches that bound: a full bucket emptied at t0 and again at
// t0 + Period, and not one token more by then.
func TestTokenBucketAtMostCapPlusRatePerPeriod(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"tb": {Rate: 10, Period: time.Second}})
	runSteps(t, b, "tb", "k", []step{
		{at: t0, count: 10, ok: true, value: 0},
		{at: t0.Add(time.Second), count: 10, ok: true, value: 0},
		{at: t0.Add(time.Second), count: 1e-6, retryAt: t0.Add(time.Second + time.Microsecond), value: 0}, // 0.1 µs, rounded up
	})
}

// docs/spec.md §6 (LimitMany): granted, ManyResult.RetryAt is the latest RetryAt of its
// reservations; denied, the latest RetryAt of the denied requests, a request that alone would be
// granted as a reservation not counting, and each request that alone would be granted reports the
// Value it would have left, with nothing consumed.
func TestLimitManyRetryAt(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{
		"a": {Rate: 1, Period: time.Second, MaxReserved: ratelimit.Unbounded},
		"b": {Rate: 2, Period: time.Second, MaxReserved: ratelimit.Unbounded},
		"c": {Rate: 3, Period: time.Second},
		"d": {Rate: 1, Period: time.Minute, MaxReserved: ratelimit.Unbounded},
	})
	type want struct {
		ok, reserved bool
		retryAt      time.Time
		value        float64
	}
	check := func(what string, m ratelimit.ManyResult, ok bool, retryAt time.Time, results []want) {
		t.Helper()
		if m.OK != ok || !m.RetryAt.Equal(retryAt) || !m.Time.Equal(t0) {
			t.Errorf("%s: ok %v retryAt t0+%v time %v; want ok %v retryAt t0+%v", what, m.OK, sinceT0(m.RetryAt), m.Time, ok, sinceT0(retryAt))
		}
		for i, w := range results {
			r := m.Results[i]
			if r.OK != w.ok || r.Reserved != w.reserved || !r.RetryAt.Equal(w.retryAt) || r.Value != w.value {
				t.Errorf("%s: step %d (%s): got ok %v reserved %v retryAt t0+%v value %v; want ok %v reserved %v retryAt t0+%v value %v",
					what, i, r.Name, r.OK, r.Reserved, sinceT0(r.RetryAt), r.Value, w.ok, w.reserved, sinceT0(w.retryAt), w.value)
			}
		}
	}
	m, err := b.lim.LimitMany(b.ctx, b.pool, []ratelimit.Request{
		{Name: "a", Key: "k", Count: 3, Reserve: true}, // −2: out of debt in 2 s
		{Name: "b", Key: "k", Count: 3, Reserve: true}, // −1: in 500 ms
		{Name: "c", Key: "k"},                          // 2 left, no wait
	}, nil)
	require.NoError(t, err)
	check("granted", m, true, t0.Add(2*time.Second), []want{
		{true, true, t0.Add(2 * time.Second), -2}, {true, true, t0.Add(500 * ms), -1}, {true, false, time.Time{}, 2}})

	m, err = b.lim.LimitMany(b.ctx, b.pool, []ratelimit.Request{
		{Name: "a", Key: "k"},                          // −3: denied, 3 s
		{Name: "b", Key: "k"},                          // −2: denied, 1 s
		{Name: "c", Key: "k", Count: 2},                // alone: granted, 0 left
		{Name: "d", Key: "k", Count: 2, Reserve: true}, // alone: reserved at −1, due in a minute
	}, nil)
	require.NoError(t, err)
	check("denied", m, false, t0.Add(3*time.Second), []want{
		{false, false, t0.Add(3 * time.Second), -2}, {false, false, t0.Add(time.Second), -1}, {true, false, time.Time{}, 0},
		{true, true, t0.Add(time.Minute), -1}})
	var le *ratelimit.LimitedError
	require.ErrorAs(t, m.Err(), &le, "ManyResult.Err")
	require.True(t, le.RetryAt.Equal(t0.Add(3*time.Second)) && le.Name == "a" && len(le.Denied) == 2,
		"ManyResult.Err: %s/%s retryAt t0+%v, %d denied", le.Name, le.Key, sinceT0(le.RetryAt), len(le.Denied))
	for name, v := range map[string]float64{"a": -2, "b": -1, "c": 2, "d": 1} {
		st, err := b.lim.State(b.ctx, b.pool, name, "k", nil)
		require.NoError(t, err)
		require.Equal(t, v, st.Value, "%s: the denied call consumed", name)
	}
}

// docs/spec.md §6 (Credit): each row becomes min(v_now + count, cap), its ts moving as in §3 (to
// the clock) and §4 (to the start of the current window).
func TestCreditMovesTS(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{
		"tb": {Rate: 10, Period: time.Second},
		"fw": {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, Capacity: 8, Start: t0},
	})
	for _, c := range []struct {
		name     string
		take     float64
		creditAt time.Time
		count    float64
		credited float64
		value    float64
		ts       time.Time
		retryAt  time.Time // of a call for value + 1 after the credit
	}{
		// 0 at t0; 3 at t0 + 300 ms, 5 after the credit, stamped t0 + 300 ms.
		{"tb", 10, t0.Add(300 * ms), 2, 2, 5, t0.Add(300 * ms), t0.Add(400 * ms)},
		// 0 at t0; the window of t0 + 1m brings 5, 7 after the credit, stamped t0 + 1m.
		{"fw", 8, t0.Add(70 * time.Second), 2, 2, 7, t0.Add(time.Minute), t0.Add(2 * time.Minute)},
	} {
		b.clock.Set(t0)
		r, err := b.lim.LimitN(b.ctx, b.pool, c.name, "k", c.take, nil)
		require.NoError(t, err)
		require.True(t, r.OK, c.name)
		b.clock.Set(c.creditAt)
		cr, err := b.lim.Credit(b.ctx, b.pool, c.name, "k", c.count, nil)
		require.NoError(t, err)
		require.Equal(t, ratelimit.CreditResult{Name: c.name, Key: "k", Credited: c.credited, Value: c.value, Time: c.creditAt}, cr)
		st, err := b.lim.State(b.ctx, b.pool, c.name, "k", nil)
		require.NoError(t, err)
		require.True(t, st.TS.Equal(c.ts), "%s: ts t0+%v, want t0+%v", c.name, sinceT0(st.TS), sinceT0(c.ts))
		require.Equal(t, c.value, st.Value, c.name)
		// The row after the credit is (value, ts): one more token than it holds comes then.
		r, err = b.lim.CheckN(b.ctx, b.pool, c.name, "k", c.value+1, nil)
		require.NoError(t, err)
		require.True(t, r.RetryAt.Equal(c.retryAt), "%s: retryAt t0+%v, want t0+%v", c.name, sinceT0(r.RetryAt), sinceT0(c.retryAt))
	}
}
