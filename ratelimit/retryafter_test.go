package ratelimit_test

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// TestOutOfDebtAt: a row's state (value, ts) is out of debt at the RetryAt of the reservation that
// left it there (docs/spec.md §3, §4), and tokens credited since, added to its value, bring that
// instant forward: exact numbers, several rows in one call, answers in their order.
func TestOutOfDebtAt(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{
		"tok":  {Rate: 10, Period: time.Second, MaxReserved: 100},
		"win":  {Kind: ratelimit.FixedWindow, Rate: 5, Period: 10 * time.Second, Start: t0, MaxReserved: 100},
		"hot":  {Rate: 10, Period: time.Second, Shards: 2, MaxReserved: 100},
		"odd":  {Rate: 3, Period: 7 * time.Second, MaxReserved: 100},
		"oddw": {Kind: ratelimit.FixedWindow, Rate: 0.7, Period: 3 * time.Second, Start: t0.Add(time.Second), MaxReserved: 100},
	})
	inline := ratelimit.Config{Rate: 1, Period: time.Minute}
	s := time.Second
	steps := []struct {
		from time.Time // zero: the Limiter's clock, t0
		rows []ratelimit.Row
		want []time.Time
	}{
		// 10/s bucket at −5: 500 ms; credited 2 at the same instant, 300 ms; credited 5, at once.
		{rows: []ratelimit.Row{{Name: "tok", Value: -5, TS: t0}, {Name: "tok", Value: -3, TS: t0}, {Name: "tok", Value: 0, TS: t0}},
			want: []time.Time{t0.Add(500 * ms), t0.Add(300 * ms), t0}},
		// Searched from later: still 500 ms; past it, from itself.
		{from: t0.Add(400 * ms), rows: []ratelimit.Row{{Name: "tok", Value: -5, TS: t0}}, want: []time.Time{t0.Add(500 * ms)}},
		{from: t0.Add(600 * ms), rows: []ratelimit.Row{{Name: "tok", Value: -5, TS: t0}}, want: []time.Time{t0.Add(600 * ms)}},
		// A fixed window of 5 per 10 s at −3 (credited 1: −2) is out of debt at the next window
		// start; at −8, two windows; −8 credited 3 is −5, one window.
		{from: t0.Add(4 * s), rows: []ratelimit.Row{{Name: "win", Value: -2, TS: t0}, {Name: "win", Value: -8, TS: t0}, {Name: "win", Value: -5, TS: t0}},
			want: []time.Time{t0.Add(10 * s), t0.Add(20 * s), t0.Add(10 * s)}},
		// Sharded: a row is one shard's, refilled at Rate/Shards (5/s).
		{rows: []ratelimit.Row{{Name: "hot", Value: -5, TS: t0}}, want: []time.Time{t0.Add(s)}},
		// An inline config, for a name that is not registered, and a key.
		{rows: []ratelimit.Row{{Name: "adhoc", Key: "u1", Config: &inline, Value: -0.5, TS: t0}}, want: []time.Time{t0.Add(30 * s)}},
	}
	for i, st := range steps {
		got, err := b.lim.OutOfDebtAt(b.ctx, b.pool, st.from, st.rows)
		require.NoError(t, err, "step %d", i)
		require.Equal(t, st.want, got, "step %d: got … want …", i)
	}

	// For the row a reservation left (Result.Value, Result.TS), the answer is its RetryAt, to the
	// microsecond, also where float8 rounding decides it.
	for i, r := range []struct {
		name  string
		at    time.Time
		count float64
	}{
		{"tok", t0, 12}, {"tok", t0.Add(123 * time.Microsecond), 1.1}, {"odd", t0.Add(s), 4.3}, {"odd", t0.Add(2 * s), 0.1},
		{"win", t0.Add(3 * s), 9}, {"oddw", t0.Add(5 * s), 2.2}, {"oddw", t0.Add(11 * s), 0.3},
	} {
		b.clock.Set(r.at)
		res, err := b.lim.LimitN(b.ctx, b.pool, r.name, "k", r.count, &ratelimit.LimitOpts{Reserve: true})
		require.NoError(t, err)
		require.True(t, res.Reserved, "reservation %d", i)
		got, err := b.lim.OutOfDebtAt(b.ctx, b.pool, time.Time{}, []ratelimit.Row{{Name: r.name, Key: "k", Value: res.Value, TS: res.TS}})
		require.NoError(t, err)
		require.Equal(t, res.RetryAt, got[0], "reservation %d: got … want the reservation's RetryAt", i)
	}
}

// closedPool returns a closed pool of b's database: a call that sends a statement on it fails.
func closedPool(t *testing.T, b *testBundle) *pgxpool.Pool {
	t.Helper()
	closed, err := pgxpool.New(b.ctx, b.pool.Config().ConnString())
	require.NoError(t, err)
	closed.Close()
	return closed
}

// TestOutOfDebtAtBadInput: bad input is an ErrInvalid error naming what is wrong, with no SQL run
// (the pool is closed); no rows is no answer.
func TestOutOfDebtAtBadInput(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"tok": {Rate: 10, Period: time.Second}})
	closed := closedPool(t, b)
	got, err := b.lim.OutOfDebtAt(b.ctx, closed, time.Time{}, nil)
	require.NoError(t, err)
	require.Empty(t, got)
	var unknown *ratelimit.UnknownLimitError
	_, err = b.lim.OutOfDebtAt(b.ctx, closed, time.Time{}, []ratelimit.Row{{Name: "nope", Value: -1, TS: t0}})
	require.ErrorAs(t, err, &unknown)
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
	for _, c := range []struct {
		db   ratelimit.Executor
		row  ratelimit.Row
		want string
	}{
		{nil, ratelimit.Row{Name: "tok", Value: -1, TS: t0}, "db"},
		{closed, ratelimit.Row{Name: "tok", Value: math.NaN(), TS: t0}, "rows[1].Value"},
		{closed, ratelimit.Row{Name: "tok", Value: math.Inf(-1), TS: t0}, "rows[1].Value"},
		{closed, ratelimit.Row{Name: "tok", Value: -1}, "rows[1].TS"},
		{closed, ratelimit.Row{Name: "tok", Value: -1, TS: time.Date(290000, 1, 1, 0, 0, 0, 0, time.UTC)}, "rows[1].TS"},
		{closed, ratelimit.Row{Name: "tok", Value: -1, TS: time.Date(-150000, 1, 1, 0, 0, 0, 0, time.UTC)}, "rows[1].TS"},
	} {
		_, err := b.lim.OutOfDebtAt(b.ctx, c.db, time.Time{}, []ratelimit.Row{{Name: "tok", Value: -1, TS: t0}, c.row})
		var arg *ratelimit.ArgumentError
		require.True(t, errors.As(err, &arg), "%v: got %v", c.want, err)
		require.Equal(t, c.want, arg.Arg)
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
	}
	// A from so far off that the search's arithmetic would leave a bigint (its bound is from plus
	// 2^61 µs), or that UnixMicro would wrap.
	for _, from := range []time.Time{time.Date(290000, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC)} {
		_, err := b.lim.OutOfDebtAt(b.ctx, closed, from, []ratelimit.Row{{Name: "tok", Value: -1, TS: t0}})
		var arg *ratelimit.ArgumentError
		require.True(t, errors.As(err, &arg), "from %s: got %v", from, err)
		require.Equal(t, "from", arg.Arg)
	}
	// The bound itself is accepted and answered.
	edge := time.UnixMicro(1 << 62)
	got, err = b.lim.OutOfDebtAt(b.ctx, b.pool, edge, []ratelimit.Row{{Name: "tok", Value: -1, TS: edge}})
	require.NoError(t, err)
	require.Len(t, got, 1)
	require.True(t, got[0].Equal(edge.Add(100*time.Millisecond)), "got %s", got[0])
}

// OutOfDebtAt's documentation: a TS more than 2^62 µs (about 146,000 years) from from is bad input,
// an ErrInvalid error naming the row's TS, with no SQL run (the pool is closed), as docs/spec.md
// §5 requires ("all time arithmetic is bounded for every input the validation accepts"). A from and
// a TS each within 2^62 µs of the epoch but on opposite sides were accepted, and the SQL then
// subtracted them (txlimit_level's now − ts) out of a bigint. 2^62 µs apart, either way, they are
// answered exactly. A zero from is LimiterConfig.Now's time, checked the same way.
func TestOutOfDebtAtFarApartTimes(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"tok": {Rate: 10, Period: time.Second}})
	closed := closedPool(t, b)
	const edge = 1 << 62
	refused := func(t *testing.T, lim *ratelimit.Limiter, from time.Time, ts int64, arg string) {
		t.Helper()
		_, err := lim.OutOfDebtAt(b.ctx, closed, from, []ratelimit.Row{{Name: "tok", Value: -1, TS: time.UnixMicro(ts)}})
		var ae *ratelimit.ArgumentError
		require.True(t, errors.As(err, &ae), "from %d µs, TS %d µs: got %v; want an *ArgumentError", from.UnixMicro(), ts, err)
		require.Equal(t, arg, ae.Arg)
		require.ErrorIs(t, err, ratelimit.ErrInvalid)
	}
	for _, c := range [][2]int64{ // from, ts (µs)
		{edge, -edge}, {-edge, edge}, // 2^63 apart: the reviewer's two
		{edge, -1}, {-1, edge}, // 2^62 + 1 apart
	} {
		refused(t, b.lim, time.UnixMicro(c[0]), c[1], "rows[0].TS")
	}
	for _, c := range []struct{ from, ts, want int64 }{ // µs
		// A row at −1 stamped 2^62 µs before from has refilled long before it: from itself.
		{edge, 0, edge},
		{0, -edge, 0},
		// Stamped 2^62 µs after from, it refills from its ts on: beyond the bound from + 2^61 µs,
		// which is the answer.
		{-edge, 0, -edge + 1<<61},
		{0, edge, 1 << 61},
	} {
		got, err := b.lim.OutOfDebtAt(b.ctx, b.pool, time.UnixMicro(c.from), []ratelimit.Row{{Name: "tok", Value: -1, TS: time.UnixMicro(c.ts)}})
		require.NoError(t, err, "from %d µs, TS %d µs", c.from, c.ts)
		require.Len(t, got, 1)
		require.True(t, got[0].Equal(time.UnixMicro(c.want)), "from %d µs, TS %d µs: got %d µs, want %d µs", c.from, c.ts, got[0].UnixMicro(), c.want)
	}
	// A zero from is LimiterConfig.Now's time: a TS is checked against it, and so is the time.
	for _, c := range []struct {
		now, ts int64 // µs
		arg     string
	}{{edge, -1, "rows[0].TS"}, {edge + 1, 0, "from"}} {
		lim, err := ratelimit.New(&ratelimit.LimiterConfig{
			Limits: map[string]ratelimit.Config{"tok": {Rate: 10, Period: time.Second}},
			Now:    func() time.Time { return time.UnixMicro(c.now) },
		})
		require.NoError(t, err)
		refused(t, lim, time.Time{}, c.ts, c.arg)
	}
}

// OutOfDebtAt accepts any finite Value (its documentation), and its answer is bounded by from plus
// 2^61 µs (docs/spec.md §5): a row owing nearly the largest float64, on a limit refilling 10^-9 per
// microsecond or per 100 years, is out of debt only at that bound, in pgx's default, exec and
// simple-protocol modes. The search's real-arithmetic estimate multiplied the deficit by the
// steps per period and divided it by the rate, beyond float8, and Postgres failed the call with
// "value out of range: overflow" (SQLSTATE 22003).
func TestOutOfDebtAtHugeDebt(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{0, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		b := newBundle(t, &testdb.Options{QueryExecMode: mode, MaxConns: 2}, &ratelimit.LimiterConfig{
			Now: func() time.Time { return t0 },
			Limits: map[string]ratelimit.Config{
				"µs":      {Rate: ratelimit.MinAmount, Period: time.Microsecond},
				"century": {Rate: ratelimit.MinAmount, Period: ratelimit.MaxPeriod, Shards: ratelimit.MaxShards},
				"window":  {Kind: ratelimit.FixedWindow, Rate: ratelimit.MinAmount, Period: time.Microsecond, Start: t0},
			},
		})
		for _, name := range []string{"µs", "century", "window"} {
			for _, v := range []float64{-1e300, -math.MaxFloat64} {
				got, err := b.lim.OutOfDebtAt(b.ctx, b.pool, time.Time{}, []ratelimit.Row{{Name: name, Value: v, TS: t0}})
				require.NoError(t, err, "mode %d, %s at %g", mode, name, v)
				require.Equal(t, []time.Time{time.UnixMicro(t0.UnixMicro() + 1<<61).UTC()}, got, "mode %d, %s at %g", mode, name, v)
			}
		}
	}
}
