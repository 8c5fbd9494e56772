package ratelimit_test

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// docs/spec.md §2 and §5: an injected clock (LimiterConfig.Now) is bounded like every other input.
// Every reading less than 2^61 µs (about 73,000 years) from the Unix epoch is decided with
// bounded arithmetic, in any order (a row written far in the future and then decided far in the
// past; the other order: TestInjectedClockFarApartRows); a reading beyond is an *ArgumentError
// naming LimiterConfig.Now, before any SQL runs and with nothing written. A reading in the year
// 250,000 failed with "bigint out of range" (SQLSTATE 22003), and so did a decision at -2^62 µs on
// a row written at +2^62 µs.
func TestInjectedClockBounds(t *testing.T) {
	t.Parallel()
	clock := &testClock{t: t0}
	b := newBundle(t, nil, &ratelimit.LimiterConfig{Now: clock.Now, Limits: map[string]ratelimit.Config{
		"tb": {Rate: 1e-9, Period: 100 * 365 * 24 * time.Hour, Capacity: 1, MaxReserved: ratelimit.Unbounded},
		"fw": {Kind: ratelimit.FixedWindow, Rate: 1e-9, Period: time.Microsecond, MaxReserved: 1e15},
		"sh": {Rate: 2, Period: time.Second, MaxReserved: 2, Shards: 4},
	}})
	names := []string{"fw", "sh", "tb"}
	reserve := &ratelimit.LimitOpts{Reserve: true}
	// RetryAt - Time ≤ 2^61 µs
	bounded := func(r ratelimit.Result) bool {
		return r.RetryAt.IsZero() || (!r.RetryAt.Before(r.Time) && r.RetryAt.UnixMicro()-r.Time.UnixMicro() <= 1<<61)
	}

	accepted := []time.Time{
		time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(9999, 12, 31, 23, 59, 59, 999999000, time.UTC),
		time.Date(70000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.UnixMicro(1<<61 - 1),
		time.UnixMicro(-1<<61 + 1), // decided on rows written at the reading above
		t0,
	}
	for _, now := range accepted {
		clock.Set(now)
		for _, name := range names {
			for _, opts := range []*ratelimit.LimitOpts{nil, reserve} {
				r, err := b.lim.LimitN(b.ctx, b.pool, name, "k", 1e-9, opts)
				if err != nil {
					t.Fatalf("%s: LimitN(%s): %v", now, name, err)
				}
				if math.IsNaN(r.Value) || math.IsInf(r.Value, 0) || !bounded(r) {
					t.Fatalf("%s: LimitN(%s) = %+v", now, name, r)
				}
			}
			if _, err := b.lim.CheckN(b.ctx, b.pool, name, "k", 1e-9, reserve); err != nil {
				t.Fatalf("%s: CheckN(%s): %v", now, name, err)
			}
			if _, err := b.lim.LimitMany(b.ctx, b.pool, []ratelimit.Request{{Name: name, Key: "k", Count: 1e-9}, {Name: name, Key: "j", Count: 1e-9}}, nil); err != nil {
				t.Fatalf("%s: LimitMany(%s): %v", now, name, err)
			}
			if st, err := b.lim.State(b.ctx, b.pool, name, "k", nil); err != nil || math.IsNaN(st.Value) {
				t.Fatalf("%s: State(%s) = %v, %v", now, name, st.Value, err)
			}
			if _, err := b.lim.Credit(b.ctx, b.pool, name, "k", 1e-9, nil); err != nil {
				t.Fatalf("%s: Credit(%s): %v", now, name, err)
			}
			if _, err := b.lim.Prune(b.ctx, b.pool, name, nil); err != nil {
				t.Fatalf("%s: Prune(%s): %v", now, name, err)
			}
		}
	}

	for _, name := range names {
		for _, key := range []string{"k", "j"} {
			if err := b.lim.Reset(b.ctx, b.pool, name, key); err != nil {
				t.Fatal(err)
			}
		}
	}
	refused := []time.Time{
		time.UnixMicro(1 << 61),
		time.UnixMicro(-1 << 61),
		time.Date(100000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(250000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC), // beyond int64 µs: UnixMicro wraps
		time.Date(-300000, 1, 1, 0, 0, 0, 0, time.UTC),
	}
	batcher, err := ratelimit.NewBatcher(b.pool, b.lim, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer batcher.Close()
	for _, now := range refused {
		clock.Set(now)
		calls := map[string]func() error{
			"LimitN":           func() error { _, err := b.lim.LimitN(b.ctx, b.pool, "tb", "k", 1, reserve); return err },
			"LimitN (sharded)": func() error { _, err := b.lim.LimitN(b.ctx, b.pool, "sh", "k", 1, nil); return err },
			"CheckN":           func() error { _, err := b.lim.CheckN(b.ctx, b.pool, "fw", "k", 1e-9, nil); return err },
			"LimitMany": func() error {
				_, err := b.lim.LimitMany(b.ctx, b.pool, []ratelimit.Request{{Name: "tb", Key: "k"}, {Name: "fw", Key: "k", Count: 1e-9}}, nil)
				return err
			},
			"Batcher.LimitN": func() error { _, err := batcher.LimitN(b.ctx, "tb", "k", 1, nil); return err },
			"State":          func() error { _, err := b.lim.State(b.ctx, b.pool, "tb", "k", nil); return err },
			"Credit":         func() error { _, err := b.lim.Credit(b.ctx, b.pool, "tb", "k", 1, nil); return err },
			"Prune":          func() error { _, err := b.lim.Prune(b.ctx, b.pool, "tb", nil); return err },
		}
		for what, call := range calls {
			err := call()
			var arg *ratelimit.ArgumentError
			if !errors.As(err, &arg) || arg.Arg != "LimiterConfig.Now" || !errors.Is(err, ratelimit.ErrInvalid) {
				t.Errorf("%s at %s: got %v, want an *ArgumentError naming LimiterConfig.Now", what, now, err)
			}
		}
		if n := testdb.CountRows(t, b.pool); n != 0 {
			t.Fatalf("refused calls at %s wrote %d rows", now, n)
		}
	}
}

// Readings before the Unix epoch are accepted (above), and the rules depend only on differences
// of time (docs/spec.md §3, §4): a sequence of calls gives the same answers, relative to its clock,
// at t0 as 100 days before the epoch. There, too, a missing row is full with its ts at the reading
// (token bucket) or at the start of the window holding it (fixed window, §4), not at the epoch: a
// fresh limit refills from its first call on, not from 1970.
func TestClockBeforeTheEpoch(t *testing.T) {
	t.Parallel()
	type answer struct {
		ok        bool
		value     float64
		retry, ts time.Duration // after the base; -1: zero
	}
	rel := func(at, base time.Time) time.Duration {
		if at.IsZero() {
			return -1
		}
		return at.Sub(base)
	}
	run := func(base time.Time) []answer {
		clock := &testClock{t: base}
		b := newBundle(t, nil, &ratelimit.LimiterConfig{Now: clock.Now, Limits: map[string]ratelimit.Config{
			"tb": {Rate: 1, Period: time.Second},
			// Start at the base: windows [base + k s, base + (k+1) s).
			"fw": {Kind: ratelimit.FixedWindow, Rate: 1, Period: time.Second, Start: base},
		}})
		var out []answer
		for _, name := range []string{"tb", "fw"} {
			for _, at := range []time.Duration{500 * ms, 500 * ms, 1500 * ms, 2 * time.Second} {
				clock.Set(base.Add(at))
				r, err := b.lim.Limit(b.ctx, b.pool, name, "k", nil)
				if err != nil {
					t.Fatal(err)
				}
				out = append(out, answer{r.OK, r.Value, rel(r.RetryAt, base), rel(r.TS, base)})
			}
		}
		return out
	}
	after, before := run(t0), run(time.Unix(-100*86400, 0).UTC())
	for i := range after {
		if after[i] != before[i] {
			t.Errorf("call %d: at t0 %+v, 100 days before the epoch %+v", i, after[i], before[i])
		}
	}
}

// A RetryAt or a TS that falls on the Unix epoch itself is an instant like any other, not "none":
// a denial at a reading 1 s before it, on a 1/s limit just emptied, waits until the epoch; a
// reservation there is due at the epoch; a grant at the epoch leaves its row's ts at the epoch.
func TestRetryAtAndTSAtTheEpoch(t *testing.T) {
	t.Parallel()
	epoch := time.Unix(0, 0).UTC()
	clock := &testClock{t: epoch.Add(-time.Second)}
	b := newBundle(t, nil, &ratelimit.LimiterConfig{Now: clock.Now, Limits: map[string]ratelimit.Config{
		"tb": {Rate: 1, Period: time.Second, MaxReserved: 1},
	}})
	r, err := b.lim.Limit(b.ctx, b.pool, "tb", "k", nil)
	if err != nil || !r.OK || !r.TS.Equal(epoch.Add(-time.Second)) {
		t.Fatalf("first call: %+v, %v", r, err)
	}
	r, err = b.lim.Limit(b.ctx, b.pool, "tb", "k", nil)
	if err != nil || r.OK || !r.RetryAt.Equal(epoch) || r.RetryAfter() != time.Second {
		t.Errorf("denial: ok %v retryAt %v retryAfter %v (%v); want a wait until the epoch, 1s", r.OK, r.RetryAt, r.RetryAfter(), err)
	}
	r, err = b.lim.Limit(b.ctx, b.pool, "tb", "k", &ratelimit.LimitOpts{Reserve: true})
	if err != nil || !r.Reserved || !r.RetryAt.Equal(epoch) {
		t.Errorf("reservation: reserved %v retryAt %v (%v); want due at the epoch", r.Reserved, r.RetryAt, err)
	}
	clock.Set(epoch.Add(time.Second))
	r, err = b.lim.Limit(b.ctx, b.pool, "tb", "j", nil)
	if err != nil || !r.OK || !r.TS.Equal(epoch.Add(time.Second)) {
		t.Errorf("grant: %+v, %v", r, err)
	}
	clock.Set(epoch)
	r, err = b.lim.Limit(b.ctx, b.pool, "tb", "i", nil)
	if err != nil || !r.OK || !r.TS.Equal(epoch) {
		t.Errorf("grant at the epoch: ok %v ts %v (%v); want the row's ts, the epoch", r.OK, r.TS, err)
	}
}

// Readings before year 1 (the zero time.Time) are accepted too (docs/spec.md §5: down to -2^61
// µs): a denied LimitMany there still carries the RetryAt of its denial, and so does its error;
// State's TS is the row's.
func TestTimesBeforeYearOne(t *testing.T) {
	t.Parallel()
	at := time.Date(-1000, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := &testClock{t: at}
	b := newBundle(t, nil, &ratelimit.LimiterConfig{Now: clock.Now, Limits: map[string]ratelimit.Config{
		"tb": {Rate: 1, Period: time.Second, MaxReserved: 5},
	}})
	reqs := []ratelimit.Request{{Name: "tb", Key: "a"}, {Name: "tb", Key: "b"}}
	if m, err := b.lim.LimitMany(b.ctx, b.pool, reqs, nil); err != nil || !m.OK {
		t.Fatalf("first: %+v, %v", m, err)
	}
	if st, err := b.lim.State(b.ctx, b.pool, "tb", "a", nil); err != nil || !st.TS.Equal(at) {
		t.Errorf("State: TS %v (%v), want the row's %v", st.TS, err, at)
	}
	m, err := b.lim.LimitMany(b.ctx, b.pool, reqs, &ratelimit.LimitOpts{AsError: true})
	var le *ratelimit.LimitedError
	if !errors.As(err, &le) || m.OK || !m.Results[0].RetryAt.Equal(at.Add(time.Second)) {
		t.Fatalf("second: %+v, %v", m, err)
	}
	if !m.RetryAt.Equal(at.Add(time.Second)) || m.RetryAfter() != time.Second || !le.RetryAt.Equal(at.Add(time.Second)) {
		t.Errorf("ManyResult.RetryAt %v (RetryAfter %v), LimitedError.RetryAt %v; want %v", m.RetryAt, m.RetryAfter(), le.RetryAt, at.Add(time.Second))
	}
	// A reservation there is due when its row is out of debt.
	m, err = b.lim.LimitMany(b.ctx, b.pool, []ratelimit.Request{{Name: "tb", Key: "a", Reserve: true}}, nil)
	if err != nil || !m.OK || !m.RetryAt.Equal(at.Add(time.Second)) {
		t.Errorf("reservation: ok %v RetryAt %v (%v); want %v", m.OK, m.RetryAt, err, at.Add(time.Second))
	}
}

// docs/spec.md §5: the readings LimiterConfig.Now may give are bounded so that a row written at
// one is decided at any other, whatever lies between them. The worst orders: a fixed window of 100
// years stamps its row at the start of the window holding the earliest reading, up to a Period
// before it, and a token bucket left deep in debt there refills too little to grant anything by the
// latest reading, so its RetryAt is searched up to Time + 2^61 µs. Readings up to 2^62 µs from the
// epoch were accepted, and then both failed with "bigint out of range" (SQLSTATE 22003): the
// search and the refill subtracted a row's ts from instants more than 2^63 µs after it. Within
// 2^61 µs (about 73,000 years) they are answered; at 2^61 µs and beyond, the reading is an
// *ArgumentError naming LimiterConfig.Now, with nothing written.
func TestInjectedClockFarApartRows(t *testing.T) {
	t.Parallel()
	clock := &testClock{t: t0}
	b := newBundle(t, nil, &ratelimit.LimiterConfig{Now: clock.Now, Limits: map[string]ratelimit.Config{
		"tb": {Rate: 1e-9, Period: ratelimit.MaxPeriod, Capacity: 1, MaxReserved: ratelimit.Unbounded},
		"fw": {Kind: ratelimit.FixedWindow, Rate: 1, Period: ratelimit.MaxPeriod, Start: time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)},
	}})
	const bound = 1 << 61
	for _, at := range []int64{-bound, bound, -1<<62 + 1, 1<<62 - 1} {
		clock.Set(time.UnixMicro(at))
		_, err := b.lim.LimitN(b.ctx, b.pool, "tb", "k", 1e15, &ratelimit.LimitOpts{Reserve: true})
		var arg *ratelimit.ArgumentError
		if !errors.As(err, &arg) || arg.Arg != "LimiterConfig.Now" {
			t.Errorf("at %d µs: got %v, want an *ArgumentError naming LimiterConfig.Now", at, err)
		}
	}
	if n := testdb.CountRows(t, b.pool); n != 0 {
		t.Fatalf("refused calls wrote %d rows", n)
	}

	first, last := time.UnixMicro(-bound+1), time.UnixMicro(bound-1)
	clock.Set(first)
	r, err := b.lim.LimitN(b.ctx, b.pool, "tb", "k", 1e15, &ratelimit.LimitOpts{Reserve: true})
	if err != nil || !r.Reserved {
		t.Fatalf("reservation at the earliest reading: %+v, %v", r, err)
	}
	r, err = b.lim.Limit(b.ctx, b.pool, "fw", "k", nil)
	if err != nil || !r.OK || !r.TS.Before(first) {
		t.Fatalf("fixed window at the earliest reading: %+v, %v; want its row stamped at its window's start, before the reading", r, err)
	}
	clock.Set(last)
	r, err = b.lim.Limit(b.ctx, b.pool, "tb", "k", nil)
	if err != nil || r.OK || r.RetryAt.UnixMicro()-r.Time.UnixMicro() != bound {
		t.Errorf("token bucket at the latest reading: %+v, %v; want a denial with RetryAt = Time + 2^61 µs", r, err)
	}
	r, err = b.lim.Limit(b.ctx, b.pool, "fw", "k", nil)
	if err != nil || !r.OK {
		t.Errorf("fixed window at the latest reading: %+v, %v; want a grant", r, err)
	}
	if st, err := b.lim.State(b.ctx, b.pool, "fw", "k", nil); err != nil || st.Value != 0 {
		t.Errorf("State at the latest reading: %+v, %v", st, err)
	}
}
