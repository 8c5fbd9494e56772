// Package drivertest is the contract every driver of txlimit passes (internal/driver): one suite,
// Run, that package ratelimit's tests run on pgx (a pool, a pgx.Tx, each of pgx's query exec
// modes) and package sqldb's on database/sql (the pgx stdlib driver and lib/pq). The numbers are
// those docs/spec.md's algebra gives.
package drivertest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// Handle is one database handle under test, on a schema of its own.
type Handle struct {
	// DB makes each call a transaction of its own (a pool, a *sql.DB). Required.
	DB ratelimit.Executor
	// Begin starts a caller's transaction (serializable when asked) and returns it as an Executor
	// with its commit and rollback; one still open when the test ends is rolled back. Required.
	Begin func(t *testing.T, serializable bool) (tx ratelimit.Executor, commit, rollback func() error)
	// Inspect is a pgx pool on the same schema, for counting rows. Required.
	Inspect *pgxpool.Pool
}

// Open returns a Handle on a fresh schema, migrated when migrate is true.
type Open func(t *testing.T, migrate bool) Handle

// t0 is the instant every call of the suite decides at.
var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// limits are the suite's limits. "llm" has an explicit MaxReserved, since reservations need one.
var limits = map[string]ratelimit.Config{
	"msg":    {Rate: 10, Period: time.Minute, Capacity: 3},
	"llm":    {Rate: 100, Period: time.Second, MaxReserved: 500},
	"ip":     {Rate: 5, Period: time.Minute},
	"global": {Rate: 100, Period: time.Minute},
	"hot":    {Rate: 8, Period: time.Second, Shards: 2}, // both shards are candidates: no random pick matters
	"fw":     {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, Start: t0},
	"debt":   {Rate: 10, Period: time.Second, MaxReserved: ratelimit.Unbounded}, // +Inf travels as a parameter
}

// awkwardKeys are keys that a text encoding of a scalar or an array could misread: empty, the word
// NULL (an unquoted array element NULL is a null), surrounding blanks (trimmed from an unquoted
// element), WeirdKey, and text the simple protocol quotes into the SQL: a quote, a comment, a
// placeholder, a backslash.
var awkwardKeys = []string{"", "NULL", "null", "  padded ", WeirdKey, `'; DROP TABLE txlimit_state; --`, "$1", `\`}

// WeirdKey is a key that a text encoding of arrays must quote: a quote, a comma, braces, a
// backslash, a space, non-ASCII and the word NULL.
const WeirdKey = `we"ird, {key}\ é NULL`

func newLimiter(t *testing.T, at time.Time) *ratelimit.Limiter {
	t.Helper()
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: limits, Now: func() time.Time { return at }})
	require.NoError(t, err)
	return lim
}

// Run runs the contract on the handles open gives, each subtest on a schema of its own.
func Run(t *testing.T, open Open) {
	for _, c := range []struct {
		name     string
		migrated bool
		test     func(*testing.T, Handle)
	}{
		{"Script", true, testScript},
		{"RollbackAndCommit", true, testRollbackAndCommit},
		{"DenialWritesNothing", true, testDenialWritesNothing},
		{"Concurrent", true, testConcurrent},
		{"SerializationFailure", true, testSerializationFailure},
		{"ContextEndsWhileWaiting", true, testContextEndsWhileWaiting},
		{"NotMigrated", false, testNotMigrated},
		{"AwkwardValues", true, testAwkwardValues},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.test(t, open(t, c.migrated))
		})
	}
}

func state(t *testing.T, lim *ratelimit.Limiter, db ratelimit.Executor, name, key string) ratelimit.State {
	t.Helper()
	st, err := lim.State(context.Background(), db, name, key, nil)
	require.NoError(t, err)
	return st
}

// Script runs every kind of call on db at t0 and checks the numbers the algebra gives (docs/spec.md
// §3, §4, §6) on a schema where none of its limits has a row yet.
func Script(t *testing.T, db ratelimit.Executor) {
	t.Helper()
	ctx := context.Background()
	lim := newLimiter(t, t0)
	// Capacity 3: three grants, then a denial (RetryAt: 1 token at 10/min) that writes nothing.
	for i := 1; i <= 4; i++ {
		r, err := lim.Limit(ctx, db, "msg", "u1", nil)
		require.NoError(t, err)
		require.Equal(t, i <= 3, r.OK, "step %d: got ok %v", i, r.OK)
		require.Equal(t, float64(max(3-i, 0)), r.Value, "step %d", i)
		if i == 4 {
			require.Equal(t, 6*time.Second, r.RetryAfter()) // 1 token at 10/min
		}
	}
	require.Equal(t, 0.0, state(t, lim, db, "msg", "u1").Value)

	r, err := lim.LimitN(ctx, db, "llm", "org", 150, &ratelimit.LimitOpts{Reserve: true})
	require.NoError(t, err)
	require.True(t, r.OK)
	require.True(t, r.Reserved)
	require.Equal(t, -50.0, r.Value)
	require.Equal(t, t0.Add(500*time.Millisecond), r.RetryAt)

	due, err := lim.OutOfDebtAt(ctx, db, time.Time{}, []ratelimit.Row{{Name: "llm", Key: "org", Value: r.Value, TS: r.TS}})
	require.NoError(t, err)
	require.Equal(t, []time.Time{r.RetryAt}, due)

	r, err = lim.LimitN(ctx, db, "llm", "org", 451, &ratelimit.LimitOpts{Reserve: true}) // past MaxReserved
	require.NoError(t, err)
	require.False(t, r.OK)

	// Unbounded debt: +Inf as a scalar (one request) and in an array (a list).
	r, err = lim.LimitN(ctx, db, "debt", "a", 1000, &ratelimit.LimitOpts{Reserve: true})
	require.NoError(t, err)
	require.True(t, r.Reserved)
	require.Equal(t, -990.0, r.Value)
	require.Equal(t, t0.Add(99*time.Second), r.RetryAt)
	m, err := lim.LimitMany(ctx, db, []ratelimit.Request{{Name: "debt", Key: "b", Count: 30, Reserve: true}, {Name: "debt", Key: "c"}}, nil)
	require.NoError(t, err)
	require.True(t, m.OK)
	require.Equal(t, []float64{-20, 9}, []float64{m.Results[0].Value, m.Results[1].Value})
	require.Equal(t, t0.Add(2*time.Second), m.RetryAt)

	r, err = lim.Check(ctx, db, "msg", "u2", nil)
	require.NoError(t, err)
	require.True(t, r.OK)
	require.Equal(t, 2.0, r.Value)

	reqs := []ratelimit.Request{{Name: "ip", Key: WeirdKey, Count: 2}, {Name: "global"}, {Name: "hot", Key: "k"}}
	m, err = lim.LimitMany(ctx, db, reqs, nil)
	require.NoError(t, err)
	require.True(t, m.OK)
	// "hot" reports the two shards it looked at, 4 tokens each before.
	require.Equal(t, []float64{3, 99, 7}, []float64{m.Results[0].Value, m.Results[1].Value, m.Results[2].Value})

	m, err = lim.CheckMany(ctx, db, []ratelimit.Request{{Name: "ip", Key: WeirdKey, Count: 4}, {Name: "global"}}, nil)
	require.NoError(t, err)
	require.False(t, m.OK) // 3 left

	r, err = lim.CheckN(ctx, db, "hot", "k", 3, nil) // the shards hold 3 and 4: one alone serves
	require.NoError(t, err)
	require.True(t, r.OK)
	require.Len(t, r.Shards, 1)

	r, err = lim.LimitN(ctx, db, "hot", "k", 3, nil) // the shards hold 3 and 4
	require.NoError(t, err)
	require.True(t, r.OK)
	require.Equal(t, 4.0, r.Value)

	r, err = lim.Limit(ctx, db, "fw", "k", nil)
	require.NoError(t, err)
	require.True(t, r.OK)
	require.Equal(t, 4.0, r.Value)

	c, err := lim.Credit(ctx, db, "msg", "u1", 2, nil)
	require.NoError(t, err)
	require.Equal(t, 2.0, c.Credited)
	require.Equal(t, 2.0, c.Value)

	st := state(t, lim, db, "hot", "k")
	require.Equal(t, 4.0, st.Value) // 8 - 1 (LimitMany) - 3

	c, err = lim.Credit(ctx, db, "hot", "k", 1, nil) // to the emptier shard
	require.NoError(t, err)
	require.Equal(t, [2]float64{1, 5}, [2]float64{c.Credited, c.Value})
	require.NoError(t, lim.Reset(ctx, db, "hot", "k"))
	require.Equal(t, 8.0, state(t, lim, db, "hot", "k").Value)
	st = state(t, lim, db, "ip", WeirdKey)
	require.Equal(t, 3.0, st.Value)

	require.NoError(t, lim.Reset(ctx, db, "msg", "u1"))
	st = state(t, lim, db, "msg", "u1")
	require.Equal(t, 3.0, st.Value)
	require.True(t, st.TS.IsZero())

	require.NoError(t, ratelimit.CheckSchema(ctx, db))
}

// testScript: the script on the handle itself, then Prune an hour later, when every row is full.
func testScript(t *testing.T, h Handle) {
	Script(t, h.DB)
	n, err := newLimiter(t, t0.Add(time.Hour)).Prune(context.Background(), h.DB, "ip", nil)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
}

// testRollbackAndCommit: decisions inside the caller's transaction roll back with it (the rows as
// before) and commit with it.
func testRollbackAndCommit(t *testing.T, h Handle) {
	ctx := context.Background()
	lim := newLimiter(t, t0)

	tx, _, rollback := h.Begin(t, false)
	Script(t, tx)
	require.NoError(t, rollback())
	require.Zero(t, testdb.CountRows(t, h.Inspect))
	require.Equal(t, 100.0, state(t, lim, h.DB, "llm", "org").Value)

	tx, commit, _ := h.Begin(t, false)
	Script(t, tx)
	require.NoError(t, commit())
	require.Equal(t, -50.0, state(t, lim, h.DB, "llm", "org").Value)
	require.Equal(t, 3.0, state(t, lim, h.DB, "ip", WeirdKey).Value)

	// Capacity 3 on a row of its own: a grant in a rolled-back transaction leaves the row as before.
	r, err := lim.Limit(ctx, h.DB, "msg", "solo", nil)
	require.NoError(t, err)
	require.Equal(t, 2.0, r.Value)
	tx, _, rollback = h.Begin(t, false)
	r, err = lim.Limit(ctx, tx, "msg", "solo", nil)
	require.NoError(t, err)
	require.Equal(t, 1.0, r.Value)
	require.NoError(t, rollback())
	require.Equal(t, 2.0, state(t, lim, h.DB, "msg", "solo").Value)
}

// testDenialWritesNothing: capacity 3 grants three calls; the fourth is denied and leaves the row
// as it was (the same row version).
func testDenialWritesNothing(t *testing.T, h Handle) {
	ctx := context.Background()
	lim := newLimiter(t, t0)
	for i := 1; i <= 3; i++ {
		r, err := lim.Limit(ctx, h.DB, "msg", "d", nil)
		require.NoError(t, err)
		require.True(t, r.OK, "step %d: got denied", i)
	}
	before, found := testdb.RowVersion(t, h.Inspect, "msg", "d", 0)
	require.True(t, found)
	r, err := lim.Limit(ctx, h.DB, "msg", "d", nil)
	require.NoError(t, err)
	require.False(t, r.OK)
	require.Equal(t, t0.Add(6*time.Second), r.RetryAt)
	after, _ := testdb.RowVersion(t, h.Inspect, "msg", "d", 0)
	require.Equal(t, before, after)
}

// testConcurrent: calls racing for one row of capacity 3 on the handle (each a transaction of its
// own, some queued behind the others) are granted exactly three times.
func testConcurrent(t *testing.T, h Handle) {
	ctx := context.Background()
	lim := newLimiter(t, t0)
	const calls = 12
	granted := make(chan bool, calls)
	var wg sync.WaitGroup
	for range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := lim.Limit(ctx, h.DB, "msg", "race", nil)
			granted <- err == nil && r.OK
			if err != nil {
				t.Errorf("Limit: %v", err)
			}
		}()
	}
	wg.Wait()
	close(granted)
	n := 0
	for ok := range granted {
		if ok {
			n++
		}
	}
	require.Equal(t, 3, n)
	require.Equal(t, 0.0, state(t, lim, h.DB, "msg", "race").Value)
}

// testSerializationFailure: a serialization failure is retryable (SQLSTATE 40001 as a
// *pgconn.PgError), whatever the driver.
func testSerializationFailure(t *testing.T, h Handle) {
	ctx := context.Background()
	lim := newLimiter(t, t0)
	_, err := lim.Limit(ctx, h.DB, "msg", "u", nil) // the row exists
	require.NoError(t, err)

	// late is rolled back when the test ends.
	late, _, _ := h.Begin(t, true)
	_, err = lim.Check(ctx, late, "msg", "u", nil) // takes late's snapshot
	require.NoError(t, err)

	early, commit, _ := h.Begin(t, true)
	r, err := lim.Limit(ctx, early, "msg", "u", nil)
	require.NoError(t, err)
	require.True(t, r.OK)
	require.NoError(t, commit())

	_, err = lim.Limit(ctx, late, "msg", "u", nil)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "40001", pgErr.Code)
	require.True(t, ratelimit.IsRetryable(err))
}

// testContextEndsWhileWaiting: a call whose context ends while it waits for a row another
// transaction holds returns an error matching the context's (docs/spec.md §7), whatever the driver
// (lib/pq reports the cancelled statement as SQLSTATE 57014 alone).
func testContextEndsWhileWaiting(t *testing.T, h Handle) {
	ctx := context.Background()
	lim := newLimiter(t, t0)
	_, err := lim.Limit(ctx, h.DB, "msg", "held", nil) // the row exists
	require.NoError(t, err)
	holder, err := h.Inspect.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, "SELECT 1 FROM txlimit_state WHERE name = 'msg' AND key = 'held' FOR UPDATE")
	require.NoError(t, err)
	for what, call := range map[string]func(context.Context) error{
		"Limit": func(c context.Context) error { _, err := lim.Limit(c, h.DB, "msg", "held", nil); return err },
		"Credit": func(c context.Context) error {
			_, err := lim.Credit(c, h.DB, "msg", "held", 1, nil)
			return err
		},
		"Reset": func(c context.Context) error { return lim.Reset(c, h.DB, "msg", "held") },
	} {
		c, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		err := call(c)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded, what)
	}
}

// testNotMigrated: a missing table is a *SetupError naming the fix, with the SQLSTATE.
func testNotMigrated(t *testing.T, h Handle) {
	ctx := context.Background()
	_, err := newLimiter(t, t0).Limit(ctx, h.DB, "msg", "u1", nil)
	require.ErrorIs(t, err, ratelimit.ErrSetup)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Contains(t, []string{"42P01", "42883"}, pgErr.Code)
	require.Contains(t, err.Error(), "migrations.Up")
	require.Contains(t, err.Error(), " does not exist in search_path ") // Postgres's message, without the driver's prefix
	require.ErrorIs(t, ratelimit.CheckSchema(ctx, h.DB), ratelimit.ErrSetup)
}

// testAwkwardValues: every statement with the values an exec mode that encodes arguments from their
// Go types (pgx's exec and simple protocol, database/sql's drivers) could misread: the database's
// clock (a NULL now_us), an injected clock before 1970 and at either end of the range
// LimiterConfig.Now accepts (negative and huge now_us), a fixed window whose Start lies before the
// epoch (a negative anchor), the bounds 1e-9 and 1e15 of counts and capacities, and awkwardKeys in
// scalars and in arrays (LimitMany's and Prune's).
func testAwkwardValues(t *testing.T, h Handle) {
	ctx := context.Background()
	century := 100 * 365 * 24 * time.Hour
	start := time.Date(1900, 1, 1, 0, 0, 0, 0, time.UTC)
	awkward := map[string]ratelimit.Config{
		"fw":   {Kind: ratelimit.FixedWindow, Rate: 3, Period: century, Start: start},
		"fw2":  {Kind: ratelimit.FixedWindow, Rate: 3, Period: century, Start: start, MaxReserved: 4},
		"msg":  limits["msg"],
		"ip":   limits["ip"],
		"big":  {Rate: 1e15, Period: century},
		"tiny": {Rate: 1e-9, Period: century},
	}
	// The window holding any instant of this test: it started at start + 1 century (1999-12-08),
	// and the next starts a century later.
	windowEnd := start.Add(2 * century)

	t.Run("DatabaseClock", func(t *testing.T) {
		lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: awkward})
		require.NoError(t, err)
		for _, k := range awkwardKeys {
			r, err := lim.Limit(ctx, h.DB, "fw", k, nil) // DecideOneRow
			require.NoError(t, err)
			require.Equal(t, [2]any{true, 2.0}, [2]any{r.OK, r.Value}, "key %q", k)
			r, err = lim.Check(ctx, h.DB, "fw", k, nil) // DecideOne
			require.NoError(t, err)
			require.Equal(t, [2]any{true, 1.0}, [2]any{r.OK, r.Value}, "key %q", k)
			r, err = lim.LimitN(ctx, h.DB, "fw", k, 3, nil) // a refusal: RetryAt is the next window
			require.NoError(t, err)
			require.False(t, r.OK, "key %q", k)
			require.Equal(t, windowEnd, r.RetryAt, "key %q", k)
			require.Equal(t, 2.0, state(t, lim, h.DB, "fw", k).Value, "key %q", k) // Levels
			c, err := lim.Credit(ctx, h.DB, "fw", k, 1, nil)
			require.NoError(t, err)
			require.Equal(t, [2]float64{1, 3}, [2]float64{c.Credited, c.Value}, "key %q", k)
		}
		// The rows are full again, evaluated as missing rows: Prune deletes them, one a batch, so
		// that each key is the next batch's after_key.
		n, err := lim.Prune(ctx, h.DB, "fw", &ratelimit.PruneOpts{BatchSize: 1})
		require.NoError(t, err)
		require.Equal(t, int64(len(awkwardKeys)), n)

		var reqs []ratelimit.Request // Decide: every key in the arrays
		for _, k := range awkwardKeys {
			reqs = append(reqs, ratelimit.Request{Name: "fw2", Key: k, Count: 3.5, Reserve: true})
		}
		m, err := lim.LimitMany(ctx, h.DB, reqs, nil)
		require.NoError(t, err)
		require.True(t, m.OK)
		require.Equal(t, windowEnd, m.RetryAt)
		for i, k := range awkwardKeys {
			require.True(t, m.Results[i].Reserved, "key %q", k)
			require.Equal(t, -0.5, m.Results[i].Value, "key %q", k)
			require.Equal(t, -0.5, state(t, lim, h.DB, "fw2", k).Value, "key %q", k)
		}
		r, err := lim.LimitN(ctx, h.DB, "fw", "debt", 3, nil)
		require.NoError(t, err)
		due, err := lim.OutOfDebtAt(ctx, h.DB, time.Time{}, []ratelimit.Row{{Name: "fw", Key: "debt", Value: -1, TS: r.TS}})
		require.NoError(t, err)
		require.Equal(t, []time.Time{windowEnd}, due)
		require.NoError(t, lim.Reset(ctx, h.DB, "fw", "debt"))
		for _, k := range awkwardKeys {
			require.NoError(t, lim.Reset(ctx, h.DB, "fw2", k))
			require.Equal(t, 3.0, state(t, lim, h.DB, "fw2", k).Value, "key %q", k)
		}
		require.Zero(t, testdb.CountRows(t, h.Inspect))
	})

	// An injected clock: 1960 (negative now_us), and either end of the range LimiterConfig.Now
	// accepts, 2^61 µs − 1 either side of the epoch. Each clock leaves no row behind for the next.
	for _, at := range []time.Time{
		time.Date(1960, 1, 1, 0, 0, 0, 0, time.UTC), time.UnixMicro(-(1 << 61) + 1).UTC(), time.UnixMicro(1<<61 - 1).UTC(),
	} {
		t.Run(fmt.Sprint(at.UnixMicro()), func(t *testing.T) {
			lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: awkward, Now: func() time.Time { return at }})
			require.NoError(t, err)
			for _, k := range awkwardKeys {
				for i := 1; i <= 4; i++ {
					r, err := lim.Limit(ctx, h.DB, "msg", k, nil)
					require.NoError(t, err)
					require.Equal(t, i <= 3, r.OK, "key %q step %d", k, i)
					if i == 4 {
						require.Equal(t, at.Add(6*time.Second), r.RetryAt, "key %q", k) // 1 token at 10/min
					}
				}
				due, err := lim.OutOfDebtAt(ctx, h.DB, time.Time{}, []ratelimit.Row{{Name: "msg", Key: k, Value: -1, TS: at}})
				require.NoError(t, err)
				require.Equal(t, []time.Time{at.Add(6 * time.Second)}, due, "key %q", k)
				r, err := lim.LimitN(ctx, h.DB, "big", k, 1e15, nil)
				require.NoError(t, err)
				require.Equal(t, [2]any{true, 0.0}, [2]any{r.OK, r.Value}, "key %q", k)
				r, err = lim.LimitN(ctx, h.DB, "tiny", k, 1e-9, nil)
				require.NoError(t, err)
				require.Equal(t, [2]any{true, 0.0}, [2]any{r.OK, r.Value}, "key %q", k)
				c, err := lim.Credit(ctx, h.DB, "big", k, 1e15, nil)
				require.NoError(t, err)
				require.Equal(t, [2]float64{1e15, 1e15}, [2]float64{c.Credited, c.Value}, "key %q", k)
				require.Equal(t, 1e15, state(t, lim, h.DB, "big", k).Value, "key %q", k)
				for _, name := range []string{"msg", "tiny"} {
					require.NoError(t, lim.Reset(ctx, h.DB, name, k))
				}
			}
			// "big" is full again on every key: Prune deletes its rows, one a batch.
			n, err := lim.Prune(ctx, h.DB, "big", &ratelimit.PruneOpts{BatchSize: 1})
			require.NoError(t, err)
			require.Equal(t, int64(len(awkwardKeys)), n)
			var reqs []ratelimit.Request
			for _, k := range awkwardKeys {
				reqs = append(reqs, ratelimit.Request{Name: "ip", Key: k, Count: 2})
			}
			m, err := lim.LimitMany(ctx, h.DB, reqs, nil)
			require.NoError(t, err)
			require.True(t, m.OK)
			for i, k := range awkwardKeys {
				require.Equal(t, 3.0, m.Results[i].Value, "key %q", k)
				require.NoError(t, lim.Reset(ctx, h.DB, "ip", k))
			}
			require.Zero(t, testdb.CountRows(t, h.Inspect))
		})
	}
}
