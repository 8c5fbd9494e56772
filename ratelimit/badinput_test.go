package ratelimit_test

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// docs/spec.md §5: bad input gets a clear, typed error naming what is wrong, and nothing is written.
func TestBadInputs(t *testing.T) {
	t.Parallel()
	b := setupDB(t, nil, map[string]ratelimit.Config{
		"ok":      {Rate: 10, Period: time.Second},
		"bounded": {Rate: 10, Period: time.Second, MaxReserved: 5},
		"sharded": {Rate: 8, Period: time.Second, Shards: 4}, // two shards hold 4 together
	})
	ctx, pool, lim := b.ctx, b.pool, b.lim
	cfg := func(c ratelimit.Config) *ratelimit.LimitOpts { return &ratelimit.LimitOpts{Config: &c} }
	limitN := func(name, key string, n float64, opts *ratelimit.LimitOpts) func() error {
		return func() error { _, err := lim.LimitN(ctx, pool, name, key, n, opts); return err }
	}
	var nilPool *pgxpool.Pool

	type badInput struct {
		what string
		call func() error
		// want is the error type and the words it must contain (the field or argument named).
		wantConfig, wantArg, wantUnknown bool
		contains                         string
	}
	cases := []badInput{
		{what: "count NaN", call: limitN("ok", "k", math.NaN(), nil), wantArg: true, contains: "count must be finite"},
		{what: "count +Inf", call: limitN("ok", "k", math.Inf(1), nil), wantArg: true, contains: "count must be finite"},
		{what: "count -Inf", call: limitN("ok", "k", math.Inf(-1), nil), wantArg: true, contains: "count must be finite"},
		{what: "count negative", call: limitN("ok", "k", -1, nil), wantArg: true, contains: "count must be > 0"},
		{what: "count zero", call: limitN("ok", "k", 0, nil), wantArg: true, contains: "count must be > 0"},
		{what: "count above MaxAmount", call: limitN("ok", "k", 1e16, &ratelimit.LimitOpts{Reserve: true}), wantArg: true, contains: "at most 1e+15"},
		{what: "count above capacity without reserve", call: limitN("ok", "k", 11, nil), wantArg: true, contains: "could never be granted"},
		{what: "count above capacity + MaxReserved", call: limitN("bounded", "k", 15.5, &ratelimit.LimitOpts{Reserve: true}), wantArg: true, contains: "plus MaxReserved"},
		{what: "count above two shards", call: limitN("sharded", "k", 4.5, nil), wantArg: true, contains: "two shards"},
		{what: "check count above capacity", call: func() error { _, err := lim.CheckN(ctx, pool, "ok", "k", 20, nil); return err }, wantArg: true, contains: "could never be granted"},
		{what: "empty name", call: limitN("", "k", 1, nil), wantArg: true, contains: "name must not be empty"},
		{what: "over-long name", call: limitN(strings.Repeat("n", ratelimit.MaxNameLen+1), "k", 1, nil), wantArg: true, contains: "more than 256"},
		{what: "name with NUL", call: limitN("o\x00k", "k", 1, nil), wantArg: true, contains: "NUL"},
		{what: "name not UTF-8", call: limitN("ok\xff", "k", 1, nil), wantArg: true, contains: "UTF-8"},
		{what: "over-long key", call: limitN("ok", strings.Repeat("k", ratelimit.MaxKeyLen+1), 1, nil), wantArg: true, contains: "MaxKeyLen"},
		{what: "key with NUL", call: limitN("ok", "a\x00b", 1, nil), wantArg: true, contains: "NUL"},
		{what: "key not UTF-8", call: limitN("ok", "\xc3\x28", 1, nil), wantArg: true, contains: "UTF-8"},
		{what: "unknown name", call: limitN("nope", "k", 1, nil), wantUnknown: true, contains: `"nope"`},
		{what: "rate zero", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Period: time.Second})), wantConfig: true, contains: "Config.Rate must be > 0"},
		{what: "rate negative", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: -1, Period: time.Second})), wantConfig: true, contains: "Config.Rate must not be negative"},
		{what: "rate NaN", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: math.NaN(), Period: time.Second})), wantConfig: true, contains: "Config.Rate must be finite"},
		{what: "rate +Inf", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: math.Inf(1), Period: time.Second})), wantConfig: true, contains: "Config.Rate must be finite"},
		{what: "period zero", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: 1})), wantConfig: true, contains: "Config.Period must be > 0"},
		{what: "period negative", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: 1, Period: -time.Second})), wantConfig: true, contains: "Config.Period must be > 0"},
		{what: "period below a microsecond", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: 1, Period: 1500 * time.Nanosecond})), wantConfig: true, contains: "whole number of microseconds"},
		{what: "capacity negative", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: 1, Period: time.Second, Capacity: -2})), wantConfig: true, contains: "Config.Capacity"},
		{what: "capacity NaN", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: 1, Period: time.Second, Capacity: math.NaN()})), wantConfig: true, contains: "Config.Capacity"},
		{what: "maxReserved negative", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: 1, Period: time.Second, MaxReserved: -1})), wantConfig: true, contains: "Config.MaxReserved"},
		{what: "maxReserved -Inf", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: 1, Period: time.Second, MaxReserved: math.Inf(-1)})), wantConfig: true, contains: "Config.MaxReserved"},
		{what: "reserve with MaxReserved 0", call: func() error {
			_, err := lim.LimitN(ctx, pool, "inline", "k", 1, &ratelimit.LimitOpts{Reserve: true, Config: &ratelimit.Config{Rate: 1, Period: time.Second}})
			return err
		}, wantArg: true, contains: "MaxReserved 0"},
		{what: "shards negative", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: 1, Period: time.Second, Shards: -1})), wantConfig: true, contains: "Config.Shards"},
		{what: "shards too many", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: 1, Period: time.Second, Shards: ratelimit.MaxShards + 1})), wantConfig: true, contains: "Config.Shards"},
		{what: "unknown kind", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Kind: 7, Rate: 1, Period: time.Second})), wantConfig: true, contains: "Config.Kind"},
		{what: "Start on a token bucket", call: limitN("inline", "k", 1, cfg(ratelimit.Config{Rate: 1, Period: time.Second, Start: t0})), wantConfig: true, contains: "Config.Start"},
		{what: "nil executor", call: func() error { _, err := lim.Limit(ctx, nil, "ok", "k", nil); return err }, wantArg: true, contains: "db is nil"},
		{what: "typed nil pool", call: func() error { _, err := lim.Limit(ctx, nilPool, "ok", "k", nil); return err }, wantArg: true, contains: "nil *pgxpool.Pool"},
		{what: "many: no requests", call: func() error { _, err := lim.LimitMany(ctx, pool, nil, nil); return err }, wantArg: true, contains: "requests must not be empty"},
		{what: "many: Reserve in opts", call: func() error {
			_, err := lim.LimitMany(ctx, pool, []ratelimit.Request{{Name: "ok", Key: "k"}}, &ratelimit.LimitOpts{Reserve: true})
			return err
		}, wantArg: true, contains: "opts sets Config or Reserve, which a LimitMany or CheckMany takes in each Request"},
		{what: "many: Config in opts", call: func() error {
			_, err := lim.CheckMany(ctx, pool, []ratelimit.Request{{Name: "ok", Key: "k"}}, &ratelimit.LimitOpts{Config: &ratelimit.Config{Rate: 1, Period: time.Second}})
			return err
		}, wantArg: true, contains: "opts sets Config or Reserve"},
		{what: "State: Reserve in opts", call: func() error {
			_, err := lim.State(ctx, pool, "ok", "k", &ratelimit.LimitOpts{Reserve: true})
			return err
		}, wantArg: true, contains: "opts sets Reserve or AsError, which only a decision reads: State reads only opts.Config"},
		{what: "Credit: AsError in opts", call: func() error {
			_, err := lim.Credit(ctx, pool, "ok", "k", 1, &ratelimit.LimitOpts{AsError: true})
			return err
		}, wantArg: true, contains: "Credit reads only opts.Config"},
		{what: "many: the same limit twice", call: func() error {
			_, err := lim.LimitMany(ctx, pool, []ratelimit.Request{{Name: "ok", Key: "k"}, {Name: "ok", Key: "k"}}, nil)
			return err
		}, wantArg: true, contains: "appears twice"},
		{what: "many: negative count", call: func() error {
			_, err := lim.LimitMany(ctx, pool, []ratelimit.Request{{Name: "ok", Key: "k"}, {Name: "bounded", Key: "k", Count: -3}}, nil)
			return err
		}, wantArg: true, contains: "count must be > 0"},
		{what: "credit NaN", call: func() error { _, err := lim.Credit(ctx, pool, "ok", "k", math.NaN(), nil); return err }, wantArg: true, contains: "count must be finite"},
		{what: "credit zero", call: func() error { _, err := lim.Credit(ctx, pool, "ok", "k", 0, nil); return err }, wantArg: true, contains: "count must be > 0"},
		{what: "value of an unknown name", call: func() error { _, err := lim.State(ctx, pool, "nope", "k", nil); return err }, wantUnknown: true, contains: `"nope"`},
		{what: "reset with an over-long key", call: func() error { return lim.Reset(ctx, pool, "ok", strings.Repeat("x", 2000)) }, wantArg: true, contains: "MaxKeyLen"},
		{what: "New with a bad config", call: func() error {
			_, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{"x": {Rate: 1}}})
			return err
		}, wantConfig: true, contains: `limit "x": Config.Period`},
		{what: "New with an empty name", call: func() error {
			_, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{"": {Rate: 1, Period: time.Second}}})
			return err
		}, wantArg: true, contains: "name must not be empty"},
	}
	require.GreaterOrEqual(t, len(cases), 20)
	for _, c := range cases {
		err := c.call()
		require.Error(t, err, c.what)
		require.ErrorIs(t, err, ratelimit.ErrInvalid, "%s: %v", c.what, err)
		var (
			ce *ratelimit.ConfigError
			ae *ratelimit.ArgumentError
			ue *ratelimit.UnknownLimitError
		)
		require.Equal(t, c.wantConfig, errorsAs(err, &ce), "%s: %T %v", c.what, err, err)
		require.Equal(t, c.wantArg, errorsAs(err, &ae), "%s: %T %v", c.what, err, err)
		require.Equal(t, c.wantUnknown, errorsAs(err, &ue), "%s: %T %v", c.what, err, err)
		require.Contains(t, err.Error(), c.contains, c.what)
		require.Zero(t, testdb.CountRows(t, pool), "%s wrote a row", c.what)
	}
}

// TestErrorsNameTheCall: an error names the call the user made, not the call it is shorthand for
// (issue 31: Limit reported "ratelimit: LimitN:"). Each call gets a key with a NUL byte, refused
// before any SQL runs.
func TestErrorsNameTheCall(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"a": {Rate: 10, Period: time.Second}})
	ctx, pool, lim := b.ctx, b.pool, b.lim
	const bad = "k\x00"
	many := []ratelimit.Request{{Name: "a", Key: bad}}
	steps := []struct {
		call string
		err  error
	}{
		{"Limit", second(lim.Limit(ctx, pool, "a", bad, nil))},
		{"LimitN", second(lim.LimitN(ctx, pool, "a", bad, 1, nil))},
		{"Check", second(lim.Check(ctx, pool, "a", bad, nil))},
		{"CheckN", second(lim.CheckN(ctx, pool, "a", bad, 1, nil))},
		{"LimitMany", second(lim.LimitMany(ctx, pool, many, nil))},
		{"CheckMany", second(lim.CheckMany(ctx, pool, many, nil))},
		{"Credit", second(lim.Credit(ctx, pool, "a", bad, 1, nil))},
		{"State", second(lim.State(ctx, pool, "a", bad, nil))},
		{"Reset", lim.Reset(ctx, pool, "a", bad)},
		{"Lookup", second(lim.Lookup("a", bad, nil))},
	}
	for i, s := range steps {
		want := "ratelimit: " + s.call + ": key contains a NUL byte, which Postgres text cannot hold"
		if s.err == nil || s.err.Error() != want {
			t.Errorf("step %d %s: got %v, want %s", i, s.call, s.err, want)
		}
	}
	if n := testdb.CountRows(t, pool); n != 0 {
		t.Errorf("the refused calls wrote %d rows", n)
	}
}

// second returns the error of a call that returns a value and an error.
func second[T any](_ T, err error) error { return err }

// errorsAs is errors.As, in an expression.
func errorsAs[T error](err error, target *T) bool { return errors.As(err, target) }

// A count that the bound cap + MaxReserved admits only through float rounding (0.1 + 0.2 is
// 0.30000000000000004) is refused by the rule even on full rows, so it is an argument error, not a
// denial that never pays off (docs/spec.md §5); the count just under it is granted.
func TestCountBoundRoundedUp(t *testing.T) {
	t.Parallel()
	b := setupDB(t, nil, map[string]ratelimit.Config{
		"one": {Rate: 0.1, Period: time.Second, MaxReserved: 0.2},            // capacity 0.1
		"two": {Rate: 0.2, Period: time.Second, MaxReserved: 0.4, Shards: 2}, // per shard 0.1 and 0.2
	})
	reserve := &ratelimit.LimitOpts{Reserve: true}
	tenth, fifth := 0.1, 0.2 // float64 arithmetic (a constant expression would be exact)
	for _, c := range []struct {
		name      string
		bad, good float64
	}{
		{"one", tenth + fifth, 0.3},
		{"two", 2 * (tenth + fifth), 0.6},
	} {
		require.Greater(t, c.bad, c.good)
		_, err := b.lim.LimitN(b.ctx, b.pool, c.name, "k", c.bad, reserve)
		var arg *ratelimit.ArgumentError
		require.ErrorAs(t, err, &arg, "%s: %g", c.name, c.bad)
		require.Equal(t, "count", arg.Arg)
		r, err := b.lim.LimitN(b.ctx, b.pool, c.name, "k", c.good, reserve)
		require.NoError(t, err)
		require.True(t, r.OK, "%s: %g on full rows", c.name, c.good)
		require.True(t, r.Reserved)
	}
}

// docs/spec.md §5: the bounds of the config table and of count are inclusive, at the numbers the
// spec gives: Rate, Capacity, MaxReserved and count from 1e-9 to 1e15, Period up to 100 × 365 days,
// Shards up to 1024; the next float64 (or microsecond, or shard) beyond each is an error.
func TestBoundsAreTheSpecsNumbers(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	const lo, hi = 1e-9, 1e15
	below, above := math.Nextafter(lo, 0), math.Nextafter(hi, math.Inf(1))
	century := 100 * 365 * 24 * time.Hour
	tb := func(rate, capacity, maxReserved float64) ratelimit.Config {
		return ratelimit.Config{Rate: rate, Period: time.Second, Capacity: capacity, MaxReserved: maxReserved}
	}
	for i, c := range []struct {
		cfg   ratelimit.Config
		field string // "": valid
	}{
		{tb(lo, 0, 0), ""}, {tb(hi, 0, 0), ""}, {tb(below, 0, 0), "Rate"}, {tb(above, 0, 0), "Rate"},
		{tb(1, lo, 0), ""}, {tb(1, hi, 0), ""}, {tb(1, below, 0), "Capacity"}, {tb(1, above, 0), "Capacity"},
		{tb(1, 0, lo), ""}, {tb(1, 0, hi), ""}, {tb(1, 0, ratelimit.Unbounded), ""},
		{tb(1, 0, below), "MaxReserved"}, {tb(1, 0, above), "MaxReserved"},
		{ratelimit.Config{Rate: 1, Period: century}, ""},
		{ratelimit.Config{Rate: 1, Period: century + time.Microsecond}, "Period"},
		{ratelimit.Config{Rate: 1, Period: time.Microsecond}, ""},
		{ratelimit.Config{Rate: 1, Period: time.Second, Shards: 1024}, ""},
		{ratelimit.Config{Rate: 1, Period: time.Second, Shards: 1025}, "Shards"},
	} {
		_, err := b.lim.Lookup("n", "k", &c.cfg)
		var ce *ratelimit.ConfigError
		if c.field == "" {
			require.NoError(t, err, "step %d: %+v", i, c.cfg)
		} else if !errors.As(err, &ce) || ce.Field != c.field {
			t.Errorf("step %d: %+v: got %v, want a *ConfigError naming %s", i, c.cfg, err, c.field)
		}
	}
	unbounded := tb(hi, hi, ratelimit.Unbounded)
	for i, c := range []struct {
		count float64
		ok    bool
	}{{lo, true}, {hi, true}, {below, false}, {above, false}} {
		_, err := b.lim.CheckN(b.ctx, b.pool, "n", "k", c.count, &ratelimit.LimitOpts{Config: &unbounded, Reserve: true})
		var ae *ratelimit.ArgumentError
		if c.ok {
			require.NoError(t, err, "step %d: count %g", i, c.count)
		} else if !errors.As(err, &ae) || ae.Arg != "count" {
			t.Errorf("step %d: count %g: got %v, want an *ArgumentError naming count", i, c.count, err)
		}
	}
	// The spec's example: 10 per second, capacity 10, bounds a count at 10, and at 5 with Shards 4.
	for _, c := range []struct {
		shards int
		most   float64
	}{{0, 10}, {4, 5}} {
		cfg := ratelimit.Config{Rate: 10, Period: time.Second, Shards: c.shards}
		for _, n := range []float64{c.most, math.Nextafter(c.most, math.Inf(1))} {
			_, err := b.lim.CheckN(b.ctx, b.pool, "n", "k", n, &ratelimit.LimitOpts{Config: &cfg})
			var ae *ratelimit.ArgumentError
			if ok := n == c.most; ok != (err == nil) || (!ok && (!errors.As(err, &ae) || ae.Arg != "count")) {
				t.Errorf("shards %d: count %g: got %v, want an error only above %g", c.shards, n, err, c.most)
			}
		}
	}
}
