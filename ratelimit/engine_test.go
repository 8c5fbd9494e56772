package ratelimit_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// at is t0 plus us microseconds: times too far ahead for a time.Duration.
func at(us int64) time.Time { return time.UnixMicro(t0.UnixMicro() + us).UTC() }

// docs/spec.md §7: a list is decided in one statement, requests on one key one after another in
// list order, each group all or nothing and seeing the groups granted before it.
func TestListDecidesOneKeyInOrder(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"five": {Rate: 5, Period: time.Second}})
	one := func(count float64, dry bool) ratelimit.ListCall {
		return ratelimit.ListCall{Single: true, Dry: dry, Reqs: []ratelimit.Request{{Name: "five", Key: "k", Count: count}}}
	}
	got, errs, err := ratelimit.DecideList(b.ctx, b.lim, b.pool, []ratelimit.ListCall{
		one(4, false), // 5 - 4 = 1
		one(3, false), // 1 < 3: denied, nothing written
		one(1, false), // the later, smaller request is still granted: 0 left
		{Reqs: []ratelimit.Request{{Name: "five", Key: "other"}, {Name: "five", Key: "k"}}}, // k is empty: the group is denied, other untouched
		one(1, true), // Check sees the 0 left
		{Reqs: []ratelimit.Request{{Name: "five", Key: "other", Count: 2}}}, // other is still full
	})
	require.NoError(t, err)
	want := []struct {
		ok      bool
		value   float64
		retryAt time.Time
	}{
		{true, 1, time.Time{}},
		{false, 1, t0.Add(400 * ms)}, // 2 more tokens at 5/s
		{true, 0, time.Time{}},
		{false, 0, t0.Add(200 * ms)},
		{false, 0, t0.Add(200 * ms)},
		{true, 3, time.Time{}},
	}
	for i, w := range want {
		require.NoError(t, errs[i], "call %d", i)
		g := got[i]
		last := g.Results[len(g.Results)-1]
		if g.OK != w.ok || last.Value != w.value || !g.RetryAt.Equal(w.retryAt) || !g.Time.Equal(t0) {
			t.Errorf("call %d: got ok=%v value=%v retryAt=%v time=%v; want ok=%v value=%v retryAt=%v",
				i, g.OK, last.Value, sinceT0(g.RetryAt), g.Time, w.ok, w.value, sinceT0(w.retryAt))
		}
	}
	require.True(t, got[3].Results[0].OK, "other alone would have been granted")
	for key, want := range map[string]float64{"k": 0, "other": 3} {
		st, err := b.lim.State(b.ctx, b.pool, "five", key, nil)
		require.NoError(t, err)
		require.Equal(t, want, st.Value, key)
	}
}

// listAnswer is what ratelimit.DecideList returned.
type listAnswer struct {
	res  []ratelimit.ManyResult
	errs []error
	err  error
}

// decideListAsync decides calls as one list on b's pool in a goroutine of its own, for a test that
// acts while the list waits for a lock; the answer arrives on the channel.
func decideListAsync(b *testBundle, calls []ratelimit.ListCall) <-chan listAnswer {
	done := make(chan listAnswer, 1)
	go func() {
		res, errs, err := ratelimit.DecideList(b.ctx, b.lim, b.pool, calls)
		done <- listAnswer{res, errs, err}
	}()
	return done
}

// A list of calls on keys of their own is first tried in one UPDATE of their rows (txlimit_alone);
// a request it does not write (a refusal, a missing row, a Check, a reservation) is decided on its
// row as read, or by the rest of the road. The answers must be exactly those of the rules,
// whichever step decided them.
func TestListOfKeysGrantedInOneUpdate(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"five": {Rate: 5, Period: time.Second, MaxReserved: 2}})
	for key, count := range map[string]float64{"a": 1, "b": 5, "d": 2, "e": 5} {
		_, err := b.lim.LimitN(b.ctx, b.pool, "five", key, count, nil)
		require.NoError(t, err)
	}
	one := func(key string, count float64, dry, reserve bool) ratelimit.ListCall {
		return ratelimit.ListCall{Single: true, Dry: dry,
			Reqs: []ratelimit.Request{{Name: "five", Key: key, Count: count, Reserve: reserve}}}
	}
	got, errs, err := ratelimit.DecideList(b.ctx, b.lim, b.pool, []ratelimit.ListCall{
		one("c", 2, false, false), // missing: created full and charged, 3 left
		one("b", 1, false, false), // empty: refused, 1 token in 200 ms
		one("d", 1, true, false),  // Check on 3: granted, writes nothing
		one("a", 3, false, false), // 4 - 3 = 1, in the UPDATE
		one("e", 1, false, true),  // empty, Reserve: reserved down to -1, paid back in 200 ms
	})
	require.NoError(t, err)
	want := []struct {
		ok, reserved bool
		value        float64
		retryAt      time.Time
	}{
		{true, false, 3, time.Time{}},
		{false, false, 0, t0.Add(200 * ms)},
		{true, false, 2, time.Time{}},
		{true, false, 1, time.Time{}},
		{true, true, -1, t0.Add(200 * ms)}, // OK: granted, as a reservation
	}
	for i, w := range want {
		require.NoError(t, errs[i], "call %d", i)
		r := got[i].Results[0]
		if r.OK != w.ok || r.Reserved != w.reserved || r.Value != w.value || !r.RetryAt.Equal(w.retryAt) || !r.Time.Equal(t0) {
			t.Errorf("call %d: got ok=%v reserved=%v value=%v retryAt=%v; want ok=%v reserved=%v value=%v retryAt=%v",
				i, r.OK, r.Reserved, r.Value, sinceT0(r.RetryAt), w.ok, w.reserved, w.value, sinceT0(w.retryAt))
		}
	}
	for key, want := range map[string]float64{"a": 1, "b": 0, "c": 3, "d": 3, "e": -1} {
		st, err := b.lim.State(b.ctx, b.pool, "five", key, nil)
		require.NoError(t, err)
		require.Equal(t, want, st.Value, key)
	}
}

// A list whose every call is granted now on a key of its own is decided by the one UPDATE alone:
// every row it wrote carries the command ID of the list's first statement in the transaction
// (cmin 0; the steps of the road for lists would have read and locked the rows first), so which
// road wrote them shows, not only what they hold.
func TestListOfKeysAllGrantedInOneUpdate(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"five": {Rate: 5, Period: time.Second}})
	for _, key := range []string{"a", "b", "c"} {
		_, err := b.lim.LimitN(b.ctx, b.pool, "five", key, 1, nil)
		require.NoError(t, err)
	}
	b.clock.Set(t0.Add(100 * ms)) // half a token back: 4.5 each
	var calls []ratelimit.ListCall
	for _, key := range []string{"c", "a", "b"} {
		calls = append(calls, ratelimit.ListCall{Single: true, Reqs: []ratelimit.Request{{Name: "five", Key: key, Count: 2}}})
	}
	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	got, errs, err := ratelimit.DecideList(b.ctx, b.lim, tx, calls)
	require.NoError(t, err)
	for i := range calls {
		require.NoError(t, errs[i])
		r := got[i].Results[0]
		require.True(t, r.OK && !r.Reserved, "call %d", i)
		require.Equal(t, 2.5, r.Value, "call %d", i)
		require.True(t, r.RetryAt.IsZero() && r.Time.Equal(t0.Add(100*ms)), "call %d", i)
	}
	require.Equal(t, 3, testdb.RowsWrittenByFirstCommand(t, tx, "five"), "rows written by the list's first statement")
	require.NoError(t, tx.Commit(b.ctx))
	for _, key := range []string{"a", "b", "c"} {
		st, err := b.lim.State(b.ctx, b.pool, "five", key, nil)
		require.NoError(t, err)
		require.Equal(t, 2.5, st.Value, key)
	}
}

// docs/spec.md §7: two calls never deadlock. A list whose one UPDATE grants some of its rows but not
// all must not keep those rows locked while it waits for another: here it would hold c while
// waiting for b, which a transaction holds that then asks for c.
func TestListOfKeysPartialUpdateHoldsNoLocks(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"five": {Rate: 5, Period: time.Second, MaxReserved: 2}})
	for key, count := range map[string]float64{"a": 1, "b": 4, "c": 1} {
		_, err := b.lim.LimitN(b.ctx, b.pool, "five", key, count, nil)
		require.NoError(t, err)
	}
	one := func(key string, count float64, reserve bool) ratelimit.ListCall {
		return ratelimit.ListCall{Single: true, Reqs: []ratelimit.Request{{Name: "five", Key: key, Count: count, Reserve: reserve}}}
	}
	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	_, errs, err := ratelimit.DecideList(b.ctx, b.lim, tx, []ratelimit.ListCall{one("b", 1, false)}) // holds b: 0 left
	require.NoError(t, err)
	require.NoError(t, errs[0])
	pid := tx.Conn().PgConn().PID()

	// a and c are granted now, b only as a reservation: the UPDATE is undone, and the usual road
	// waits for b.
	done := decideListAsync(b, []ratelimit.ListCall{one("a", 1, false), one("b", 2, true), one("c", 1, false)})
	eventually(t, "the list waits for b", func() bool {
		return testdb.BlockedBy(t, b.pool, pid) == 1
	})
	_, errs, err = ratelimit.DecideList(b.ctx, b.lim, tx, []ratelimit.ListCall{one("c", 1, false)}) // c: 3 left
	require.NoError(t, err)
	require.NoError(t, errs[0])
	require.NoError(t, tx.Commit(b.ctx))

	got := <-done
	require.NoError(t, got.err)
	want := []struct {
		ok, reserved bool
		value        float64
	}{{true, false, 3}, {true, true, -2}, {true, false, 2}}
	for i, w := range want {
		require.NoError(t, got.errs[i], "call %d", i)
		r := got.res[i].Results[0]
		require.Equal(t, w, struct {
			ok, reserved bool
			value        float64
		}{r.OK, r.Reserved, r.Value}, "call %d", i)
	}
}

// docs/spec.md §5: time arithmetic is bounded for every accepted input. Waits of thousands of
// years are exact; a wait beyond MaxRetryWaitMicros is reported as that bound. The old loop that
// adjusted a float64 wait never returned for waits above 2^53 µs.
func TestRetryAtFarAhead(t *testing.T) {
	t.Parallel()
	period := ratelimit.MaxPeriod.Microseconds() // 100 years
	for _, kind := range []ratelimit.Kind{ratelimit.TokenBucket, ratelimit.FixedWindow} {
		t.Run(kind.String(), func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			start := time.Time{}
			if kind == ratelimit.FixedWindow {
				start = t0
			}
			b := setup(t, map[string]ratelimit.Config{
				// One token per century, 50 of them may be owed.
				"century": {Kind: kind, Rate: 1, Period: ratelimit.MaxPeriod, MaxReserved: 50, Start: start},
				// The slowest rate there is, with no bound on what may be owed.
				"glacial": {Kind: kind, Rate: ratelimit.MinAmount, Capacity: 1, Period: ratelimit.MaxPeriod, MaxReserved: ratelimit.Unbounded, Start: start},
			})
			limit := func(name string, count float64, reserve bool) ratelimit.Result {
				t.Helper()
				res, err := b.lim.LimitN(ctx, b.pool, name, "k", count, &ratelimit.LimitOpts{Reserve: reserve})
				require.NoError(t, err)
				return res
			}
			// earliest checks that RetryAt is the first microsecond at which the same call is
			// granted, as the database evaluates it, and within slack µs of the real-arithmetic
			// wait (float8 counts microseconds exactly only up to 2^53, about 285 years).
			earliest := func(what string, res ratelimit.Result, count float64, reserve bool, wait int64, slack float64) {
				t.Helper()
				require.False(t, res.OK, what)
				require.InDelta(t, wait, res.RetryAt.UnixMicro()-t0.UnixMicro(), slack, what)
				if kind == ratelimit.FixedWindow {
					require.Equal(t, at(wait), res.RetryAt, "%s: window starts are exact", what)
				}
				for _, probe := range []struct {
					at time.Time
					ok bool
				}{{res.RetryAt.Add(-time.Microsecond), false}, {res.RetryAt, true}} {
					b.clock.Set(probe.at)
					got, err := b.lim.CheckN(ctx, b.pool, "century", "k", count, &ratelimit.LimitOpts{Reserve: reserve})
					require.NoError(t, err)
					require.Equal(t, probe.ok, got.OK, "%s at RetryAt%+v", what, probe.at.Sub(res.RetryAt))
				}
				b.clock.Set(t0)
			}
			require.True(t, limit("century", 1, false).OK)
			// Denied: the next token comes in a century.
			earliest("denied", limit("century", 1, false), 1, false, period, 0)
			// Reserved 50 tokens: due in 5,000 years, when the row is out of debt.
			res := limit("century", 50, true)
			require.True(t, res.Reserved)
			require.InDelta(t, 50*period, res.RetryAt.UnixMicro()-t0.UnixMicro(), 32)
			if kind == ratelimit.FixedWindow {
				require.Equal(t, at(50*period), res.RetryAt, "window starts are exact")
			}
			due := res.RetryAt
			for _, probe := range []struct {
				at   time.Time
				paid bool
			}{{due.Add(-time.Microsecond), false}, {due, true}} {
				b.clock.Set(probe.at)
				st, err := b.lim.State(ctx, b.pool, "century", "k", nil)
				require.NoError(t, err)
				require.Equal(t, probe.paid, st.Value >= 0, "at due%+v: %v", probe.at.Sub(due), st.Value)
			}
			b.clock.Set(t0)
			// One more would owe 51 > 50: it fits a century later.
			earliest("refused reservation", limit("century", 1, true), 1, true, period, 32)

			// 10^9 centuries per token: far past the bound, which is what is reported.
			require.True(t, limit("glacial", 1, false).OK)
			res = limit("glacial", 1, false)
			require.False(t, res.OK)
			require.Equal(t, at(ratelimit.MaxRetryWaitMicros), res.RetryAt)
			res = limit("glacial", 1e6, true)
			require.True(t, res.Reserved)
			require.Equal(t, at(ratelimit.MaxRetryWaitMicros), res.RetryAt)
			require.Equal(t, time.Duration(1<<63-1), res.RetryAfter(), "RetryAfter saturates")
		})
	}
}

// A missing row that a list creates to lock it is stamped with the config of the request granted
// on it, not that of another request of the list on the same row (here a Check with a smaller
// capacity, before it): the list decides as the calls one by one would, and nothing else is left
// in the row. (The stamp shows when little has refilled since the epoch: a period of 100 years.)
func TestListStampsAMissingRowWithTheGrantedConfig(t *testing.T) {
	t.Parallel()
	small := ratelimit.Config{Rate: 1, Period: ratelimit.MaxPeriod, Capacity: 5}
	big := ratelimit.Config{Rate: 1, Period: ratelimit.MaxPeriod, Capacity: 10}
	b := setup(t, nil)
	got, errs, err := ratelimit.DecideList(b.ctx, b.lim, b.pool, []ratelimit.ListCall{
		{Reqs: []ratelimit.Request{{Name: "n", Key: "k", Count: 1, Config: &small}}, Single: true, Dry: true},
		{Reqs: []ratelimit.Request{{Name: "n", Key: "k", Count: 8, Config: &big}}, Single: true},
	})
	require.NoError(t, err)
	require.NoError(t, errs[1])
	r := got[1].Results[0]
	require.True(t, r.OK, "the list refused what the call alone is granted: value %v", r.Value)
	require.Equal(t, 2.0, r.Value)

	one, err := b.lim.LimitN(b.ctx, b.pool, "n", "k2", 8, &ratelimit.LimitOpts{Config: &big})
	require.NoError(t, err)
	require.True(t, one.OK)
	require.Equal(t, one.Value, r.Value, "as the call alone")
	st, err := b.lim.State(b.ctx, b.pool, "n", "k", &ratelimit.LimitOpts{Config: &big})
	require.NoError(t, err)
	require.Equal(t, 2.0, st.Value)
}

// docs/spec.md §3: a reservation refused because it would owe more than MaxReserved gets the
// RetryAt at which the same reservation is granted: one microsecond earlier it is still refused.
// The same holds for a plain refusal.
func TestRefusedRetryAtIsTheEarliestGrant(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		cfg     ratelimit.Config
		setup   []float64 // reservations made at t0 first
		count   float64
		reserve bool
		wait    time.Duration
	}{
		// 10/s, up to 5 owed: at -4, 3 more would owe 7; at -2 (200 ms later) they fit.
		{"token bucket reserve", ratelimit.Config{Rate: 10, Period: time.Second, MaxReserved: 5}, []float64{10, 4}, 3, true, 200 * ms},
		{"token bucket", ratelimit.Config{Rate: 10, Period: time.Second, MaxReserved: 5}, []float64{10, 4}, 1, false, 500 * ms},
		// At -3.182, 1 needs 4.182 more: 418.2 ms, where float8 has the row at 1 (just); the
		// real-arithmetic estimate, ceil(4.182·10⁶/10) µs, is a microsecond later, and the search
		// walks back from it.
		{"token bucket, estimate a microsecond late", ratelimit.Config{Rate: 10, Period: time.Second, MaxReserved: 5}, []float64{10, 3.182}, 1, false, 418200 * time.Microsecond},
		// 5 a minute, up to 12 owed: at -10, 5 more would owe 15; the next window brings -5.
		{"fixed window reserve", ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, MaxReserved: 12, Start: t0}, []float64{5, 10}, 5, true, time.Minute},
		{"fixed window", ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, MaxReserved: 12, Start: t0}, []float64{5, 10}, 1, false, 3 * time.Minute},
		// 4 shards of 10/s, capacity 2 and 1 owed each; picks 0 and 1, both charged to end equal.
		// At -1 each, 1 more would leave -1.5 each; at -0.5 each (50 ms later) it fits.
		{"sharded reserve", ratelimit.Config{Rate: 40, Period: time.Second, Capacity: 8, MaxReserved: 4, Shards: 4}, []float64{4, 2}, 1, true, 50 * ms},
		// Without Reserve, 1 needs 0.5 on each: 150 ms.
		{"sharded", ratelimit.Config{Rate: 40, Period: time.Second, Capacity: 8, MaxReserved: 4, Shards: 4}, []float64{4, 2}, 1, false, 150 * ms},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, map[string]ratelimit.Config{"l": c.cfg})
			ratelimit.SetShardPicker(b.lim, func(int) (int, int) { return 0, 1 })
			for i, n := range c.setup {
				res, err := b.lim.LimitN(b.ctx, b.pool, "l", "k", n, &ratelimit.LimitOpts{Reserve: i > 0})
				require.NoError(t, err)
				require.True(t, res.OK, "setup %d", i)
			}
			opts := &ratelimit.LimitOpts{Reserve: c.reserve}
			res, err := b.lim.LimitN(b.ctx, b.pool, "l", "k", c.count, opts)
			require.NoError(t, err)
			require.False(t, res.OK)
			require.Equal(t, t0.Add(c.wait), res.RetryAt, "RetryAt t0+%v", sinceT0(res.RetryAt))

			b.clock.Set(res.RetryAt.Add(-time.Microsecond))
			early, err := b.lim.CheckN(b.ctx, b.pool, "l", "k", c.count, opts)
			require.NoError(t, err)
			require.False(t, early.OK, "one microsecond early")
			require.Equal(t, res.RetryAt, early.RetryAt)

			b.clock.Set(res.RetryAt)
			then, err := b.lim.LimitN(b.ctx, b.pool, "l", "k", c.count, opts)
			require.NoError(t, err)
			require.True(t, then.OK, "at RetryAt")
		})
	}
}

// Calls report the config in force: Capacity and Shards with their defaults applied.
func TestConfigInForce(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"pm": ratelimit.Config{Rate: 5, Period: time.Minute}})
	want := ratelimit.Config{Rate: 5, Period: time.Minute, Capacity: 5, Shards: 1}
	cfg, err := b.lim.Lookup("pm", "k", nil)
	require.NoError(t, err)
	require.Equal(t, want, cfg)
	st, err := b.lim.State(b.ctx, b.pool, "pm", "k", nil)
	require.NoError(t, err)
	require.Equal(t, want, st.Config)
	res, err := b.lim.Limit(b.ctx, b.pool, "pm", "k", nil)
	require.NoError(t, err)
	require.Equal(t, want, res.Config)
	require.Equal(t, 4.0, res.Value)
	require.Equal(t, "token bucket 5/1m0s", ratelimit.Config{Rate: 5, Period: time.Minute}.String())
}

// docs/spec.md §5: every call returns within its context: at once when it has already ended, and
// when its deadline passes while it waits for a row another transaction holds.
func TestEveryCallHonoursItsContext(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"tb": {Rate: 10, Period: time.Second, MaxReserved: 5}})
	_, err := b.lim.Limit(b.ctx, b.pool, "tb", "k", nil) // the row exists
	require.NoError(t, err)
	calls := map[string]func(ctx context.Context) error{
		"Limit":  func(ctx context.Context) error { _, err := b.lim.Limit(ctx, b.pool, "tb", "k", nil); return err },
		"LimitN": func(ctx context.Context) error { _, err := b.lim.LimitN(ctx, b.pool, "tb", "k", 2, nil); return err },
		"Reserve": func(ctx context.Context) error {
			_, err := b.lim.LimitN(ctx, b.pool, "tb", "k", 12, &ratelimit.LimitOpts{Reserve: true})
			return err
		},
		"LimitMany": func(ctx context.Context) error {
			_, err := b.lim.LimitMany(ctx, b.pool, []ratelimit.Request{{Name: "tb", Key: "k"}}, nil)
			return err
		},
		"Credit": func(ctx context.Context) error { _, err := b.lim.Credit(ctx, b.pool, "tb", "k", 1, nil); return err },
		"Reset":  func(ctx context.Context) error { return b.lim.Reset(ctx, b.pool, "tb", "k") },
	}
	readers := map[string]func(ctx context.Context) error{
		"Check":  func(ctx context.Context) error { _, err := b.lim.Check(ctx, b.pool, "tb", "k", nil); return err },
		"CheckN": func(ctx context.Context) error { _, err := b.lim.CheckN(ctx, b.pool, "tb", "k", 2, nil); return err },
		"CheckMany": func(ctx context.Context) error {
			_, err := b.lim.CheckMany(ctx, b.pool, []ratelimit.Request{{Name: "tb", Key: "k"}}, nil)
			return err
		},
		"State": func(ctx context.Context) error { _, err := b.lim.State(ctx, b.pool, "tb", "k", nil); return err },
		"Prune": func(ctx context.Context) error { _, err := b.lim.Prune(ctx, b.pool, "tb", nil); return err },
	}

	ended, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	for _, set := range []map[string]func(context.Context) error{calls, readers} {
		for what, call := range set {
			require.ErrorIs(t, call(ended), context.DeadlineExceeded, "%s with an ended context", what)
		}
	}

	// Another transaction holds the row: every call that writes it waits, until its deadline.
	holder, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer holder.Rollback(b.ctx) //nolint:errcheck
	testdb.LockRow(t, holder, "tb", "k", 0)
	for what, call := range calls {
		ctx, cancel := context.WithTimeout(context.Background(), 200*ms)
		err := call(ctx)
		cancel()
		require.Error(t, err, what)
		require.True(t, errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil, "%s: %v", what, err)
	}
}

// A request refused on the rows as read and granted on the rows as locked (a concurrent Credit
// committed in between) reports no RetryAt: it is granted now. Both roads of a list: calls of one
// request each (a Batcher's batch), and a list with a group of two requests.
func TestListRegrantedOnLockedRowsHasNoRetryAt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		calls []ratelimit.ListCall
	}{
		{"one request per call", []ratelimit.ListCall{
			{Single: true, Reqs: []ratelimit.Request{{Name: "four", Key: "k1", Count: 2}}},
			{Single: true, Reqs: []ratelimit.Request{{Name: "four", Key: "k1", Count: 2}}},
		}},
		{"a group of two", []ratelimit.ListCall{
			{Reqs: []ratelimit.Request{{Name: "four", Key: "k2", Count: 2}, {Name: "four", Key: "other"}}},
			{Reqs: []ratelimit.Request{{Name: "four", Key: "k2", Count: 2}}},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, map[string]ratelimit.Config{"four": {Rate: 4, Period: time.Hour}})
			b.pool = testdb.Pool(t, &testdb.Options{MaxConns: 4})
			key := tc.calls[0].Reqs[0].Key
			r, err := b.lim.Limit(b.ctx, b.pool, "four", key, nil) // 3 left
			require.NoError(t, err)
			require.True(t, r.OK)

			holder, err := b.pool.Begin(b.ctx)
			require.NoError(t, err)
			defer holder.Rollback(b.ctx)
			c, err := b.lim.Credit(b.ctx, holder, "four", key, 1, nil) // 4, not yet committed
			require.NoError(t, err)
			require.Equal(t, 4.0, c.Value)

			// As read: 3 tokens, so the first call is granted (1 left) and the second refused.
			// As locked, after the Credit commits: 4, so both are granted (2, then 0 left).
			done := decideListAsync(b, tc.calls)
			time.Sleep(200 * time.Millisecond)
			require.NoError(t, holder.Commit(b.ctx))
			a := <-done
			require.NoError(t, a.err)
			for i, res := range a.res {
				require.NoError(t, a.errs[i])
				require.True(t, res.OK, "call %d", i)
				require.True(t, res.Results[0].RetryAt.IsZero(), "call %d: RetryAt %v for a grant", i, res.Results[0].RetryAt)
			}
			require.Equal(t, 0.0, a.res[1].Results[0].Value)
		})
	}
}

// A list's request alone on a missing row that sorts before a row the list's first UPDATE found
// (txlimit_alone) is only tried (txlimit_lock_row's p_try, docs/spec.md §7): while another
// transaction is creating that row, the request is refused to retry at once (RetryAt = Time)
// without waiting for it, and the request alone on the row found is granted.
func TestListOnlyTriesAMissingRowSortingBeforeOneFound(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"four": {Rate: 4, Period: time.Hour}})
	b.pool = testdb.Pool(t, &testdb.Options{MaxConns: 4})
	r, err := b.lim.Limit(b.ctx, b.pool, "four", "b", nil) // 3 left
	require.NoError(t, err)
	require.True(t, r.OK)

	creator, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer creator.Rollback(b.ctx) //nolint:errcheck
	// The transaction creates "a" and does not commit yet.
	r, err = b.lim.Limit(b.ctx, creator, "four", "a", nil)
	require.NoError(t, err)
	require.True(t, r.OK)

	res, errs, err := ratelimit.DecideList(b.ctx, b.lim, b.pool, []ratelimit.ListCall{
		{Single: true, Reqs: []ratelimit.Request{{Name: "four", Key: "a"}}},
		{Single: true, Reqs: []ratelimit.Request{{Name: "four", Key: "b"}}},
	})
	require.NoError(t, err)
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.False(t, res[0].OK, "the row being created was waited for")
	require.True(t, res[0].RetryAt.Equal(res[0].Time), "RetryAt %v, Time %v: not refused to retry at once", res[0].RetryAt, res[0].Time)
	require.True(t, res[1].OK)
	require.Equal(t, 2.0, res[1].Results[0].Value)
}

// A fixed window whose grid's phase after the epoch lies after now (a period of 80 years starting
// in 2040): a missing row is full at the start of the window holding now (1960), its TS is that
// start, the next window starts in 2040, and then it is full again (docs/spec.md §4). Before, the
// row was stamped at the phase itself, in the future, and the first window lasted two periods.
func TestFixedWindowPhaseAfterNow(t *testing.T) {
	t.Parallel()
	period := 80 * 365 * 24 * time.Hour
	start := time.Date(2040, 1, 1, 0, 0, 0, 0, time.UTC)
	b := setup(t, map[string]ratelimit.Config{"fw": {Kind: ratelimit.FixedWindow, Rate: 1, Period: period, Start: start}})
	now := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	b.clock.Set(now)
	winStart := start.Add(-period)
	require.True(t, !winStart.After(now) && start.After(now))

	r, err := b.lim.Limit(b.ctx, b.pool, "fw", "k", nil)
	require.NoError(t, err)
	require.True(t, r.OK)
	require.True(t, r.TS.Equal(winStart), "TS %s, want the window's start %s", r.TS, winStart)
	r, err = b.lim.Limit(b.ctx, b.pool, "fw", "k", nil)
	require.NoError(t, err)
	require.False(t, r.OK)
	require.True(t, r.RetryAt.Equal(start), "RetryAt %s, want the next window's start %s", r.RetryAt, start)
	b.clock.Set(start)
	r, err = b.lim.Limit(b.ctx, b.pool, "fw", "k", nil)
	require.NoError(t, err)
	require.True(t, r.OK, "the window starting %s refills", start)
}

// Config.Start may be any instant (docs/spec.md §4), also one beyond the ±292,000 years that
// time.Time.UnixMicro can count: a daily window anchored at a midnight of the year 300,000 (or
// -300,000) begins at midnight. UnixMicro wrapped there, and the windows began at 15:58:10.448384
// (and 08:01:49.551616).
func TestFixedWindowStartBeyondUnixMicro(t *testing.T) {
	t.Parallel()
	day := 24 * time.Hour
	for _, start := range []time.Time{
		time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(-300000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(300000, 1, 1, 6, 0, 0, 1500, time.UTC), // 06:00:00.000001 on the grid of microseconds
	} {
		b := setup(t, map[string]ratelimit.Config{"fw": {Kind: ratelimit.FixedWindow, Rate: 1, Period: day, Start: start}})
		phase := time.Duration(start.Hour())*time.Hour + time.Duration(start.Nanosecond()/1000)*time.Microsecond
		b.clock.Set(t0.Add(23 * time.Hour)) // t0 is a midnight
		r, err := b.lim.Limit(b.ctx, b.pool, "fw", "k", nil)
		require.NoError(t, err)
		want := t0.Add(phase)
		if want.After(b.clock.Now()) {
			want = want.Add(-day)
		}
		require.True(t, r.OK)
		require.True(t, r.TS.Equal(want), "Start %s: TS %s, want the window's start %s", start, r.TS, want)
		r, err = b.lim.Limit(b.ctx, b.pool, "fw", "k", nil)
		require.NoError(t, err)
		require.True(t, r.RetryAt.Equal(want.Add(day)), "Start %s: RetryAt %s, want the next window's start %s", start, r.RetryAt, want.Add(day))
	}
}
