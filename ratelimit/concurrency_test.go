package ratelimit_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// overGrantRunWindow is the over-grant test (docs/spec.md §7): burst 10, rate 10/s, cost 1, 64 goroutines on one
// key for 3 s. decide makes one decision and reports whether it was granted and when (database
// time, Result.Time); lastTS reads the limit's stored ts afterwards. It returns the grants, those
// whose call returned within 3 s of the run's start (the test's window of "at most 40"), the
// errors, and the most the limit could have granted between the first decision and the last
// grant: 10 + 10·span.
//
// Neither bound may trust Result.Time for the end of a span. It is the clock reading a decision
// was made with, and a call that waited for the row lock while a call with a later reading
// committed is evaluated at that later ts (docs/spec.md §2). So the window counts by the Go clock (every
// counted grant was evaluated inside the same 3 s of real time), and the span ends at the stored
// ts, which is the instant the last grant was evaluated at: only grants write it, and it never
// moves back.
func overGrantRunWindow(t *testing.T, decide func(ctx context.Context) (ok bool, at time.Time, err error), lastTS func() time.Time) (allowed, in3s, errs int64, max float64) {
	t.Helper()
	const goroutines = 64
	ctx := context.Background()
	var (
		mu    sync.Mutex
		first time.Time
		wg    sync.WaitGroup
	)
	start := time.Now()
	deadline := start.Add(3 * time.Second)
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				ok, at, err := decide(ctx)
				returned := time.Now()
				if err != nil {
					if atomic.AddInt64(&errs, 1) == 1 {
						t.Logf("first error: %v", err)
					}
					continue
				}
				mu.Lock()
				if first.IsZero() || at.Before(first) {
					first = at
				}
				if ok {
					allowed++
					if returned.Sub(start) <= 3*time.Second {
						in3s++
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	max = 10
	if allowed > 0 {
		max += 10 * lastTS().Sub(first).Seconds()
	}
	return allowed, in3s, errs, max
}

// overGrantLimits are the over-grant test's limit, twice: burst 10, rate 10/s.
var overGrantLimits = map[string]ratelimit.Config{
	"hot":    {Rate: 10, Period: time.Second, Capacity: 10},
	"hotToo": {Rate: 10, Period: time.Second, Capacity: 10},
}

// overGrantSetup is setupDB of overGrantLimits, on a pool of 16 connections.
func overGrantSetup(t *testing.T) *testBundle {
	return setupDB(t, &testdb.Options{MaxConns: 16}, overGrantLimits)
}

// storedTS reads the latest ts stored for name and key (over all shards).
func storedTS(t *testing.T, b *testBundle, name, key string) time.Time {
	t.Helper()
	st, err := b.lim.State(b.ctx, b.pool, name, key, nil)
	require.NoError(t, err)
	return st.TS
}

// overGrant runs the over-grant test with decide on the limit "hot", key "k" of b, and requires
// that it granted no more than the limit allows, yet close to it; unless errorsAllowed, no call
// may fail.
func overGrant(t *testing.T, mode string, b *testBundle, errorsAllowed bool, decide func(ctx context.Context) (ok bool, at time.Time, err error)) {
	t.Helper()
	hotTS := func() time.Time { return storedTS(t, b, "hot", "k") }
	allowed, in3s, errs, max := overGrantRunWindow(t, decide, hotTS)
	t.Logf("%s: allowed %d (%d within 3 s, at most 40), errors %d, max for the whole run %.2f", mode, allowed, in3s, errs, max)
	if !errorsAllowed {
		require.Zero(t, errs, "%s: calls failed", mode)
	}
	require.LessOrEqual(t, float64(allowed), max, "%s over-granted", mode)
	require.LessOrEqual(t, in3s, int64(40), "%s over-granted within 3 s", mode)
	// Not vacuous: demand far above the rate must still be served close to the limit.
	require.GreaterOrEqual(t, allowed, int64(25), "%s granted too little: the test did not exercise the limit", mode)
}

// (a) every decision on the pool, each its own statement.
func TestOverGrantPool(t *testing.T) {
	t.Parallel()
	b := overGrantSetup(t)
	pool, lim := b.pool, b.lim
	overGrant(t, "pool", b, false, func(ctx context.Context) (bool, time.Time, error) {
		r, err := lim.Limit(ctx, pool, "hot", "k", nil)
		return r.OK, r.Time, err
	})
}

// (b) every decision in its own SERIALIZABLE transaction through InSerializableTx. Errors are
// retries that ran out: they fail closed and count as denials.
func TestOverGrantSerializable(t *testing.T) {
	t.Parallel()
	b := overGrantSetup(t)
	pool, lim := b.pool, b.lim
	overGrant(t, "serializable", b, true, func(ctx context.Context) (bool, time.Time, error) {
		var r ratelimit.Result
		err := ratelimit.InSerializableTx(ctx, pool, nil, func(ctx context.Context, tx pgx.Tx) error {
			var err error
			r, err = lim.Limit(ctx, tx, "hot", "k", nil)
			return err
		})
		return r.OK, r.Time, err
	})
}

// (c) two limits taken together, all-or-nothing, in opposite orders by half the callers.
func TestOverGrantMany(t *testing.T) {
	t.Parallel()
	b := overGrantSetup(t)
	pool, lim := b.pool, b.lim
	var n atomic.Int64
	overGrant(t, "many", b, false, func(ctx context.Context) (bool, time.Time, error) {
		reqs := []ratelimit.Request{{Name: "hot", Key: "k"}, {Name: "hotToo", Key: "k"}}
		if n.Add(1)%2 == 0 {
			reqs[0], reqs[1] = reqs[1], reqs[0]
		}
		m, err := lim.LimitMany(ctx, pool, reqs, nil)
		if err != nil {
			return false, time.Time{}, err
		}
		return m.OK, m.Results[0].Time, nil
	})
	// All-or-nothing: both limits were charged by the same statements, at the same instants, so
	// read at one instant they hold the same value and the same ts. The read instant is pinned:
	// two reads on the database's clock a few milliseconds apart differ by the refill between them.
	a, err := lim.State(context.Background(), pool, "hot", "k", nil)
	require.NoError(t, err)
	at := a.Time
	pinned, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: overGrantLimits, Now: func() time.Time { return at }})
	require.NoError(t, err)
	a, err = pinned.State(context.Background(), pool, "hot", "k", nil)
	require.NoError(t, err)
	too, err := pinned.State(context.Background(), pool, "hotToo", "k", nil)
	require.NoError(t, err)
	require.Equal(t, a.TS, too.TS, "the two limits were last charged at different instants")
	require.InDelta(t, a.Value, too.Value, 1e-9, "the two limits drifted apart: %v vs %v", a.Value, too.Value)
}

// Two goroutines take the same two limits in opposite order, 1,000 times each, each call inside
// its own transaction that holds the locks until commit: never a deadlock (40P01).
func TestOppositeOrderNoDeadlock(t *testing.T) {
	t.Parallel()
	b := setupDB(t, &testdb.Options{MaxConns: 4}, map[string]ratelimit.Config{
		"x": {Rate: 1e9, Period: time.Second},
		"y": {Rate: 1e9, Period: time.Second, Shards: 2},
	})
	ctx, pool, lim := b.ctx, b.pool, b.lim
	orders := [][]ratelimit.Request{
		{{Name: "x", Key: "k"}, {Name: "y", Key: "k"}},
		{{Name: "y", Key: "k"}, {Name: "x", Key: "k"}},
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for _, reqs := range orders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 1000; i++ {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					m, err := lim.LimitMany(ctx, tx, reqs, nil)
					if err == nil && !m.OK {
						t.Errorf("iteration %d denied", i)
					}
					return err
				})
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("opposite-order LimitMany failed: %v", err)
	}
}

// docs/spec.md §7: "Rows are locked in the order (name, key, shard) ... so two calls never deadlock
// on each other's rows." Reset locks a key's rows in shard order before it deletes them, whatever
// order its plan visits them in (a sequential scan of a small, analyzed table visits them in
// physical order). With shard 3 stored before shard 1, a Reset that took shard 3 first and waited
// for shard 1 deadlocked with a call that holds shard 1 and waits for shard 3, as it may (shard 3
// sorts after 1): a sharded LimitN that charges both shards, or a Credit (which locks shards in
// ascending order). Whichever goes first, the other sees what it left: Reset deletes the rows
// LimitN wrote (the limit is full: 40), or LimitN charges fresh rows (10 + 10 + 2.5 + 2.5 = 25).
func TestResetLocksShardsInOrder(t *testing.T) {
	t.Parallel()
	for _, other := range []string{"LimitN", "Credit"} {
		t.Run(other, func(t *testing.T) {
			t.Parallel()
			// 40/s over 4 shards: 10 per shard. The clock stays at t0.
			b := setup(t, map[string]ratelimit.Config{"sh": {Rate: 40, Period: time.Second, Shards: 4}})
			ctx := b.ctx
			// Shard 3 is used first, then shard 1: their rows lie in that order in the heap.
			for _, pick := range [][2]int{{3, 2}, {1, 0}} {
				ratelimit.SetShardPicker(b.lim, func(int) (int, int) { return pick[0], pick[1] })
				r, err := b.lim.Limit(ctx, b.pool, "sh", "k", nil)
				require.NoError(t, err)
				require.Equal(t, []int{pick[0]}, r.Shards)
			}
			testdb.Analyze(t, b.pool)
			ratelimit.SetShardPicker(b.lim, func(int) (int, int) { return 1, 3 })

			// A writer holds shard 1, so that the call below takes it after Reset has started.
			holder, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = holder.Rollback(context.Background()) })
			testdb.LockRow(t, holder, "sh", "k", 1)

			callConn, resetConn := testdb.Conn(t, b.pool), testdb.Conn(t, b.pool)
			called := make(chan error, 1)
			go func() {
				var err error
				if other == "LimitN" {
					// Shards 1 and 3 hold 9 each: 15 needs both, each left at (9 + 9 − 15)/2 = 1.5.
					var r ratelimit.Result
					r, err = b.lim.LimitN(ctx, callConn, "sh", "k", 15, nil)
					if err == nil && !r.OK {
						err = errors.New("LimitN(15) denied")
					}
				} else {
					_, err = b.lim.Credit(ctx, callConn, "sh", "k", 1, nil)
				}
				called <- err
			}()
			eventually(t, other+" waits for shard 1", func() bool { return testdb.LockWait(t, b.pool, callConn.PgConn().PID()) != "" })
			reset := make(chan error, 1)
			go func() { reset <- b.lim.Reset(ctx, resetConn, "sh", "k") }()
			eventually(t, "Reset waits", func() bool { return testdb.LockWait(t, b.pool, resetConn.PgConn().PID()) != "" })
			require.NoError(t, holder.Rollback(ctx))

			errCall, errReset := <-called, <-reset
			require.NoError(t, errCall, "%s beside a Reset of the same key", other)
			require.NoError(t, errReset, "Reset beside a %s of the same key", other)
			if other == "LimitN" {
				st, err := b.lim.State(ctx, b.pool, "sh", "k", nil)
				require.NoError(t, err)
				require.Contains(t, []float64{40, 25}, st.Value, "after LimitN(15) and Reset: shards %v", st.Shards)
			}
		})
	}
}

// docs/spec.md §6: "With shards the tokens go to the emptiest shards first", and CreditResult.Value
// is "the number of tokens available after the credit, summed over every shard". Under READ
// COMMITTED a Credit that waited for a shard row held by a decision re-read that row as the
// decision left it, but a shard row the decision created was not in the Credit's snapshot and
// counted as full: the Credit acted after the decision on one shard and before it on the other.
// Credit now holds every shard in order, a missing one by the advisory lock its creator holds
// (txlimit_hold_shards), so it waits for the decision and sees both rows. Here 10/s over 2 shards
// (5 each, MaxReserved 5 each): shard 0 at 4, a transaction reserves 13 over shards 0 and 1
// (missing: 5), leaving each at (4 + 5 − 13)/2 = −2, while a Credit of 4 waits. In either serial
// order the answers agree with each other: Credit first gives 1 (shard 0 to 5, Value 10) and the
// reservation then leaves both at −1.5 (the limit holds −3); Credit second gives 4 to the emptiest
// (a tie: shard 0, to 2), Value 2 − 2 = 0, and the limit holds 0. The Credit reported Value 7 (2 + a
// "full" 5) while the limit held 0.
func TestCreditRacingADecisionReportsTheLimit(t *testing.T) {
	t.Parallel()
	// The shard with a row is shard 0 (the Credit waits for that row, the reviewer's case) or shard
	// 1 (the Credit, holding shards in order, first meets shard 0, which the decision is creating,
	// and waits for the advisory lock its creator holds). The answers are the same.
	for _, c := range []struct {
		name            string
		existing, other int
		advisory        bool
	}{{"waits for the row", 0, 1, false}, {"waits for the creator", 1, 0, true}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, map[string]ratelimit.Config{"sh": {Rate: 10, Period: time.Second, Shards: 2, MaxReserved: 10}})
			ctx := b.ctx
			ratelimit.SetShardPicker(b.lim, func(int) (int, int) { return c.existing, c.other })
			r, err := b.lim.Limit(ctx, b.pool, "sh", "k", nil) // the existing shard: 4; the other has no row
			require.NoError(t, err)
			require.Equal(t, []int{c.existing}, r.Shards)

			tx, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
			r, err = b.lim.LimitN(ctx, tx, "sh", "k", 13, &ratelimit.LimitOpts{Reserve: true})
			require.NoError(t, err)
			require.True(t, r.Reserved)
			require.Equal(t, []int{0, 1}, r.Shards)

			conn := testdb.Conn(t, b.pool)
			done := async(func() (ratelimit.CreditResult, error) { return b.lim.Credit(ctx, conn, "sh", "k", 4, nil) })
			var wait string
			eventually(t, "Credit waits for shard 0", func() bool {
				wait = testdb.LockWait(t, b.pool, conn.PgConn().PID())
				return wait != ""
			})
			require.Equal(t, c.advisory, wait == "advisory", "Credit waits on a lock of kind %q", wait)
			require.NoError(t, tx.Commit(ctx))
			cr := <-done
			require.NoError(t, cr.err)
			st, err := b.lim.State(ctx, b.pool, "sh", "k", nil)
			require.NoError(t, err)
			type credited struct{ Credited, Value, Holds float64 }
			got := credited{cr.res.Credited, cr.res.Value, st.Value}
			require.Contains(t, []credited{{1, 10, -3}, {4, 0, 0}}, got,
				"Credit(4) racing the reservation: Credited, CreditResult.Value and the State after it (shards %v)", st.Shards)
		})
	}
}

// As TestCreditRacingADecisionReportsTheLimit, for Reset: a Reset that waited for shard 0 while a
// decision charged it and created shard 1 deleted shard 0 as the decision left it but not shard 1,
// which was not in its snapshot, so the limit was left holding the decision's charge on one shard
// only (5 + −2 = 3): no serial order gives that. Reset holds every shard in order as Credit does,
// so it waits for the decision and deletes both rows (the decision, then Reset: the limit is full).
func TestResetRacingADecisionDeletesTheRowsItCreated(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"sh": {Rate: 10, Period: time.Second, Shards: 2, MaxReserved: 10}})
	ctx := b.ctx
	ratelimit.SetShardPicker(b.lim, func(int) (int, int) { return 0, 1 })
	r, err := b.lim.Limit(ctx, b.pool, "sh", "k", nil) // shard 0: 4; shard 1 has no row
	require.NoError(t, err)
	require.Equal(t, []int{0}, r.Shards)

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	r, err = b.lim.LimitN(ctx, tx, "sh", "k", 13, &ratelimit.LimitOpts{Reserve: true})
	require.NoError(t, err)
	require.Equal(t, []int{0, 1}, r.Shards) // shard 1 created by tx

	conn := testdb.Conn(t, b.pool)
	done := make(chan error, 1)
	go func() { done <- b.lim.Reset(ctx, conn, "sh", "k") }()
	eventually(t, "Reset waits for shard 0", func() bool { return testdb.LockWait(t, b.pool, conn.PgConn().PID()) != "" })
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, <-done)
	st, err := b.lim.State(ctx, b.pool, "sh", "k", nil)
	require.NoError(t, err)
	require.Equal(t, 10.0, st.Value, "after the reservation and a Reset that waited for it: shards %v", st.Shards)
	require.Zero(t, testdb.CountRows(t, b.pool))
}

// holdRow begins a transaction on b's pool that takes lock (testdb.LockRow or testdb.KeyShareRow)
// on the row of (name, key, shard 0) and holds it until the test ends, unless the caller ends it
// first.
func holdRow(t *testing.T, b *testBundle, lock func(testing.TB, pgx.Tx, string, string, int), name, key string) pgx.Tx {
	t.Helper()
	ctx := b.ctx
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	lock(t, tx, name, key, 0)
	return tx
}

// A denial visible from the lock-free read takes no row lock: it answers at once even while
// another transaction holds the row, on the pool and inside SERIALIZABLE transactions.
func TestFastDenialTakesNoLock(t *testing.T) {
	t.Parallel()
	b := setupDB(t, nil, map[string]ratelimit.Config{"l": {Rate: 1, Period: time.Hour}})
	ctx, pool, lim := b.ctx, b.pool, b.lim
	_, err := lim.Limit(ctx, pool, "l", "k", nil)
	require.NoError(t, err)

	holdRow(t, b, testdb.LockRow, "l", "k")

	quick, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	r, err := lim.Limit(quick, pool, "l", "k", nil)
	require.NoError(t, err, "the denial waited for the row lock")
	require.False(t, r.OK)

	err = ratelimit.InSerializableTx(quick, pool, nil, func(ctx context.Context, tx pgx.Tx) error {
		r, err = lim.Limit(ctx, tx, "l", "k", nil)
		return err
	})
	require.NoError(t, err, "the SERIALIZABLE denial waited for the row lock")
	require.False(t, r.OK)

	// A grant does need the lock: with a reservation it waits, and times out here.
	short, cancel2 := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel2()
	_, err = lim.Limit(short, pool, "l", "k", &ratelimit.LimitOpts{Reserve: true})
	require.Error(t, err, "a grant must wait for the row lock")
}

// docs/spec.md §5/§7 "a denial writes nothing": the row's xmin is unchanged, whether the denial came from
// the lock-free read or after waiting for the lock.
func TestDenialWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{
		"l":     {Rate: 2, Period: time.Hour, MaxReserved: 1},
		"fresh": {Rate: 5, Period: time.Hour},
	})
	ctx, pool, lim := b.ctx, b.pool, b.lim
	_, err := lim.LimitN(ctx, pool, "l", "k", 2, nil)
	require.NoError(t, err)
	before, found := testdb.RowVersion(t, pool, "l", "k", 0)
	require.True(t, found)

	for i, opts := range []*ratelimit.LimitOpts{nil, {Reserve: true}} {
		r, err := lim.LimitN(ctx, pool, "l", "k", 2, opts) // −2 is below −MaxReserved
		require.NoError(t, err)
		require.False(t, r.OK, "step %d", i)
		after, _ := testdb.RowVersion(t, pool, "l", "k", 0)
		require.Equal(t, before, after, "step %d: a fast denial wrote the row", i)
	}

	// A denial decided after the lock: the read sees tokens that a concurrent transaction is
	// taking; the decision waits for its lock, re-reads, and denies.
	require.NoError(t, lim.Reset(ctx, pool, "l", "k"))
	_, err = lim.LimitN(ctx, pool, "l", "k", 1, nil)
	require.NoError(t, err)
	taker, err := pool.Begin(ctx)
	require.NoError(t, err)
	r, err := lim.LimitN(ctx, taker, "l", "k", 1, nil)
	require.NoError(t, err)
	require.True(t, r.OK)
	done := make(chan ratelimit.Result, 1)
	go func() {
		r, err := lim.LimitN(ctx, pool, "l", "k", 1, nil)
		if err != nil {
			t.Error(err)
		}
		done <- r
	}()
	time.Sleep(200 * time.Millisecond) // let it read the row and queue on the lock
	require.NoError(t, taker.Commit(ctx))
	before, _ = testdb.RowVersion(t, pool, "l", "k", 0)
	r = <-done
	require.False(t, r.OK, "the waiting decision must see the committed consumption")
	after, _ := testdb.RowVersion(t, pool, "l", "k", 0)
	require.Equal(t, before, after, "a locked denial wrote the row")

	// An all-or-nothing denial creates no row for the limits that would have been granted.
	m, err := lim.LimitMany(ctx, pool, []ratelimit.Request{{Name: "fresh", Key: "k"}, {Name: "l", Key: "k"}}, nil)
	require.NoError(t, err)
	require.False(t, m.OK)
	_, found = testdb.RowVersion(t, pool, "fresh", "k", 0)
	require.False(t, found, "a denied LimitMany created a row")
}

// docs/spec.md §2: a decision reads the database's clock once, at the start of its statement, before
// any wait for a row lock (Result.Time). A lone Limit whose row another transaction holds waits for
// it in DecideOneRow's UPDATE; when the holder's commit leaves the row refusing the call, the
// statement goes on in txlimit_decide_one_v1, which used to read the clock a second time, after
// the wait: Time (and the instant the row was evaluated at) then lay after the holder's commit.
func TestDecisionReadsTheClockOnce(t *testing.T) {
	t.Parallel()
	b := setupDB(t, nil, map[string]ratelimit.Config{"l": {Rate: 1, Period: time.Hour, Capacity: 2}})
	ctx := b.ctx
	_, err := b.lim.LimitN(ctx, b.pool, "l", "k", 1, nil) // 1 token left
	require.NoError(t, err)
	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	r, err := b.lim.Limit(ctx, holder, "l", "k", nil) // takes it, and holds the row
	require.NoError(t, err)
	require.True(t, r.OK)
	pid := holder.Conn().PgConn().PID()

	// The call reads 1 token (its snapshot grants it), so it waits for the row in its UPDATE.
	done := make(chan ratelimit.Result, 1)
	go func() {
		r, err := b.lim.Limit(ctx, b.pool, "l", "k", nil)
		if err != nil {
			t.Error(err)
		}
		done <- r
	}()
	eventually(t, "the call waits for the row", func() bool {
		return testdb.BlockedBy(t, b.pool, pid) == 1
	})
	time.Sleep(200 * time.Millisecond)
	var released time.Time
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&released))
	require.NoError(t, holder.Commit(ctx))
	res := <-done
	require.False(t, res.OK, "the holder took the last token")
	require.True(t, res.Time.Before(released), "Time %v was read after the wait (the row was released at %v)", res.Time, released)
	require.True(t, res.RetryAt.After(released), "RetryAt %v: the row as the holder left it, about an hour ahead", res.RetryAt)
}

// docs/spec.md §7 (Isolation): under READ COMMITTED, lone calls on the pool that their row grants
// (leaving it at zero or above) queue on the row's advisory lock, so that of the calls that find
// their row held by another transaction only the first waits for the row itself; when the holder
// commits, each is decided in turn on the latest row. A call the row refuses does not queue.
func TestHeldRowQueuesOnAdvisoryLock(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"l": {Rate: 10, Period: time.Hour}})
	ctx, pool, lim := b.ctx, b.pool, b.lim
	_, err := lim.Limit(ctx, pool, "l", "k", nil) // the row exists: 9 left
	require.NoError(t, err)

	holder := holdRow(t, b, testdb.LockRow, "l", "k")
	pid := holder.Conn().PgConn().PID()

	results := make(chan ratelimit.Result, 3)
	for range 3 {
		go func() {
			r, err := lim.Limit(ctx, pool, "l", "k", nil)
			if err != nil {
				t.Error(err)
			}
			results <- r
		}()
	}
	base := ratelimit.ShardLockBase("l", "k")
	require.Eventually(t, func() bool {
		return testdb.BlockedBy(t, pool, pid) == 1 && testdb.QueueWaiters(t, pool, base, 0) == 2
	}, 5*time.Second, 10*time.Millisecond, "one call waits for the row, two for its advisory lock")

	// A call that the row, as its statement sees it, refuses does not queue behind them: a LimitN of
	// more than the row holds is refused at once, while the row and the queue are still held.
	quick, cancelQuick := context.WithTimeout(ctx, 2*time.Second)
	defer cancelQuick()
	r, err := lim.LimitN(quick, pool, "l", "k", 10, nil)
	require.NoError(t, err, "a refusal waited in the queue")
	require.False(t, r.OK)
	require.Equal(t, 9.0, r.Value)

	require.NoError(t, holder.Commit(ctx))
	levels := []float64{}
	for range 3 {
		r := <-results
		require.True(t, r.OK)
		levels = append(levels, r.Value)
	}
	require.ElementsMatch(t, []float64{8, 7, 6}, levels, "decided one after another")

	// Those calls locked the row before writing it, which leaves their lock's trace on the row;
	// the next lone call, with nobody else around, writes it in one statement again (which leaves
	// none).
	r, err = lim.Limit(ctx, pool, "l", "k", nil)
	require.NoError(t, err)
	require.Equal(t, 5.0, r.Value)
	require.Zero(t, testdb.RowLocker(t, pool, "l", "k", 0), "the call took the locking road")

	// A transaction that already holds a row waits on the row itself, as any SQL does: it does not
	// queue on the advisory lock (where it could close a deadlock with what it holds), even when a
	// call on the pool is queued there first.
	holder, err = pool.Begin(ctx)
	require.NoError(t, err)
	defer holder.Rollback(ctx)
	testdb.LockRow(t, holder, "l", "k", 0)
	pid = holder.Conn().PgConn().PID()
	decide := func(db ratelimit.Executor) {
		r, err := lim.Limit(ctx, db, "l", "k", nil)
		if err != nil {
			t.Error(err)
		}
		results <- r
	}
	go decide(pool) // holds the advisory lock, waits for the row
	require.Eventually(t, func() bool { return testdb.BlockedBy(t, pool, pid) == 1 }, 5*time.Second, 10*time.Millisecond)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = lim.Limit(ctx, tx, "l", "other", nil) // tx now holds a row
	require.NoError(t, err)
	txPID := tx.Conn().PgConn().PID()
	go decide(tx)
	require.Eventually(t, func() bool { return testdb.LockWait(t, pool, txPID) != "" }, 5*time.Second, 10*time.Millisecond)
	require.NotEqual(t, "advisory", testdb.LockWait(t, pool, txPID), "a transaction holding a row queued on the advisory lock")
	require.NoError(t, holder.Commit(ctx))
	levels = levels[:0]
	for range 2 {
		r := <-results
		require.True(t, r.OK)
		levels = append(levels, r.Value)
	}
	require.ElementsMatch(t, []float64{4, 3}, levels)
	require.NoError(t, tx.Commit(ctx))

	// A FOR KEY SHARE lock (a foreign key referencing the row) does not stop a write of value and
	// ts, whichever road the call takes.
	holdRow(t, b, testdb.KeyShareRow, "l", "k")
	quick2, cancel2 := context.WithTimeout(ctx, 2*time.Second)
	defer cancel2()
	r, err = lim.Limit(quick2, pool, "l", "k", nil)
	require.NoError(t, err, "the call waited for a key-share lock")
	require.Equal(t, 2.0, r.Value)
}

// docs/spec.md §7: inside a transaction the limit commits or rolls back with the caller's work.
func TestRollbackRestoresState(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{
		"l": {Rate: 10, Period: time.Minute},
		"m": {Rate: 4, Period: time.Minute, Shards: 2},
	})
	ctx, pool, lim := b.ctx, b.pool, b.lim
	_, err := lim.LimitN(ctx, pool, "l", "k", 3, nil)
	require.NoError(t, err)
	version, _ := testdb.RowVersion(t, pool, "l", "k", 0)

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	r, err := lim.LimitN(ctx, tx, "l", "k", 7, nil)
	require.NoError(t, err)
	require.True(t, r.OK)
	m, err := lim.LimitMany(ctx, tx, []ratelimit.Request{{Name: "m", Key: "k", Count: 3}, {Name: "l", Key: "other"}}, nil)
	require.NoError(t, err)
	require.True(t, m.OK)
	inside, err := lim.State(ctx, tx, "l", "k", nil)
	require.NoError(t, err)
	require.Equal(t, 0.0, inside.Value, "the transaction sees its own consumption")
	require.NoError(t, tx.Rollback(ctx))

	st, err := lim.State(ctx, pool, "l", "k", nil)
	require.NoError(t, err)
	require.Equal(t, 7.0, st.Value)
	after, _ := testdb.RowVersion(t, pool, "l", "k", 0)
	require.Equal(t, version, after)
	require.Equal(t, 1, testdb.CountRows(t, pool), "rows created in the transaction are gone")
}

// docs/spec.md §7 (Isolation): under REPEATABLE READ and SERIALIZABLE a row changed since the
// snapshot, or created since, is a serialization failure (40001), never a grant on the snapshot's
// tokens: here the snapshot holds 9 tokens (or no row: 10) and the row 0 when the call is made.
// The lone call (its one UPDATE first) and a list (plan, lock, decide) both fail; nothing is written.
func TestSnapshotRowChangedSinceIsASerializationFailure(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"l": {Rate: 10, Period: time.Minute}})
	ctx, pool, lim := b.ctx, b.pool, b.lim
	calls := map[string]func(tx pgx.Tx, key string) error{
		"Limit": func(tx pgx.Tx, key string) error { _, err := lim.Limit(ctx, tx, "l", key, nil); return err },
		"LimitMany": func(tx pgx.Tx, key string) error {
			_, err := lim.LimitMany(ctx, tx, []ratelimit.Request{{Name: "l", Key: key}, {Name: "l", Key: key + "/other"}}, nil)
			return err
		},
	}
	for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		for _, created := range []bool{false, true} {
			for what, call := range calls {
				key := fmt.Sprintf("%s/%s/%v", iso, what, created)
				if !created {
					_, err := lim.Limit(ctx, pool, "l", key, nil) // 9 left
					require.NoError(t, err)
				}
				tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
				require.NoError(t, err)
				_, err = tx.Exec(ctx, "SELECT 1") // the snapshot
				require.NoError(t, err)
				spend := 9.0
				if created {
					spend = 10
				}
				r, err := lim.LimitN(ctx, pool, "l", key, spend, nil) // committed after the snapshot
				require.NoError(t, err)
				require.True(t, r.OK)
				err = call(tx, key)
				require.NoError(t, tx.Rollback(ctx))
				require.True(t, isCode(err, "40001"), "%s: got %v, want a serialization failure (40001)", key, err)
				st, err := lim.State(ctx, pool, "l", key, nil)
				require.NoError(t, err)
				require.Equal(t, 0.0, st.Value, key)
			}
		}
	}
}

// countingTracer counts the statements a connection sends.
type countingTracer struct{ n atomic.Int64 }

func (c *countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// docs/spec.md §7: one decision = one SQL round trip, always: missing rows are created and locked
// inside the decision function, so even a call that charges several missing rows is one statement.
func TestOneRoundTripPerDecision(t *testing.T) {
	t.Parallel()
	tracer := &countingTracer{}
	b := setupDB(t, &testdb.Options{Tracer: tracer}, map[string]ratelimit.Config{
		"a": {Rate: 2, Period: time.Hour, MaxReserved: ratelimit.Unbounded},
		"b": {Rate: 5, Period: time.Hour, Shards: 4},
		"w": {Kind: ratelimit.FixedWindow, Rate: 3, Period: time.Hour},
	})
	ctx, pool, lim := b.ctx, b.pool, b.lim
	ratelimit.SetShardPicker(lim, func(int) (int, int) { return 0, 1 })
	type call struct {
		what string
		n    int64
		call func(db ratelimit.Executor) error
	}
	limit := func(name, key string, opts *ratelimit.LimitOpts) func(db ratelimit.Executor) error {
		return func(db ratelimit.Executor) error { _, err := lim.Limit(ctx, db, name, key, opts); return err }
	}
	many := func(reqs ...ratelimit.Request) func(db ratelimit.Executor) error {
		return func(db ratelimit.Executor) error { _, err := lim.LimitMany(ctx, db, reqs, nil); return err }
	}
	onExisting := []call{
		{"limit on an existing row", 1, limit("a", "k", nil)},
		{"denial", 1, limit("a", "k", nil)},
		{"reservation", 1, limit("a", "k", &ratelimit.LimitOpts{Reserve: true})},
		{"check", 1, func(db ratelimit.Executor) error { _, err := lim.Check(ctx, db, "a", "k", nil); return err }},
		{"fixed window", 1, limit("w", "k", nil)},
		{"sharded, rows exist", 1, limit("b", "k", nil)},
		{"many, rows exist", 1, many(ratelimit.Request{Name: "a", Key: "k", Reserve: true}, ratelimit.Request{Name: "w", Key: "k"})},
		{"credit", 1, func(db ratelimit.Executor) error { _, err := lim.Credit(ctx, db, "a", "k", 1, nil); return err }},
		{"value", 1, func(db ratelimit.Executor) error { _, err := lim.State(ctx, db, "b", "k", nil); return err }},
	}
	calls := append([]call{
		{"limit on a missing row", 1, limit("a", "k", nil)},
		{"fixed window on a missing row", 1, limit("w", "k", nil)},
		{"sharded, charging one missing shard", 1, limit("b", "k", nil)},
		{"sharded, combining two missing shards", 1, func(db ratelimit.Executor) error {
			_, err := lim.LimitN(ctx, db, "b", "fresh", 2, nil) // each shard holds 1.25: both are charged
			return err
		}},
		{"many, a missing row", 1, many(ratelimit.Request{Name: "a", Key: "k"}, ratelimit.Request{Name: "w", Key: "new"})},
	}, onExisting...)
	calls = append(calls, call{"reset", 1, func(db ratelimit.Executor) error { return lim.Reset(ctx, db, "b", "k") }})
	for _, c := range calls {
		before := tracer.n.Load()
		require.NoError(t, c.call(pool), c.what)
		require.Equal(t, c.n, tracer.n.Load()-before, "%s: statements on the pool", c.what)
	}
	// The same inside a transaction (BEGIN and COMMIT are the caller's).
	require.NoError(t, lim.Reset(ctx, pool, "a", "k"))
	_, err := lim.Limit(ctx, pool, "b", "k", nil)
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, c := range onExisting {
			before := tracer.n.Load()
			require.NoError(t, c.call(tx), c.what)
			require.Equal(t, c.n, tracer.n.Load()-before, "%s: statements in a transaction", c.what)
		}
		return nil
	}))
}
