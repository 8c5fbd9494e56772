package ratelimit_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// docs/spec.md §10: pruning deletes only rows provably equivalent to a missing row, so every future
// decision is the same with or without it.
func TestPruneNeverChangesAFutureDecision(t *testing.T) {
	t.Parallel()
	fws := ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, MaxReserved: ratelimit.Unbounded, Start: t0}
	b := setup(t, map[string]ratelimit.Config{
		"tb":  {Rate: 10, Period: time.Second, MaxReserved: ratelimit.Unbounded},
		"fw":  {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, MaxReserved: ratelimit.Unbounded},
		"fws": fws,
		"sh":  {Rate: 8, Period: time.Second, MaxReserved: ratelimit.Unbounded, Shards: 4},
	})
	ratelimit.SetShardPicker(b.lim, func(int) (int, int) { return 0, 1 })
	take := func(at time.Time, name, key string, n float64, reserve bool) {
		t.Helper()
		b.clock.Set(at)
		r, err := b.lim.LimitN(b.ctx, b.pool, name, key, n, &ratelimit.LimitOpts{Reserve: reserve})
		require.NoError(t, err)
		require.True(t, r.OK, "%s/%s", name, key)
	}
	pruneAt := t0.Add(time.Minute + 10*time.Second)
	// Full by pruneAt, so pruned:
	take(t0, "tb", "refilled", 3, false)
	take(t0, "fw", "lastWindow", 5, false) // its window (phase from the key's hash) ended by t0+1m
	take(t0, "fws", "a", 2, false)         // window [t0, t0+1m)
	take(t0, "sh", "k", 3, false)          // charges shards 0 and 1 together
	// Not full at pruneAt, so kept:
	take(pruneAt.Add(-100*ms), "tb", "partial", 10, false) // 1 token at pruneAt
	take(pruneAt, "tb", "debt", 30, true)                  // −20
	take(t0.Add(time.Minute), "fws", "b", 1, false)        // window [t0+1m, t0+2m)
	take(pruneAt.Add(-100*ms), "sh", "busy", 1.5, false)   // charges shard 0 alone: it holds 0.7 at pruneAt

	type probe struct {
		name, key string
		cfg       *ratelimit.Config
	}
	probes := []probe{{"tb", "refilled", nil}, {"tb", "partial", nil}, {"tb", "debt", nil}, {"fw", "lastWindow", nil},
		{"fws", "a", nil}, {"fws", "b", nil}, {"sh", "k", nil}, {"sh", "busy", nil}}
	future := []time.Duration{0, 300 * ms, 50 * time.Second, time.Hour}
	answers := func() []ratelimit.Result {
		var out []ratelimit.Result
		for _, p := range probes {
			for _, d := range future {
				b.clock.Set(pruneAt.Add(d))
				for _, n := range []float64{1, 2.5} {
					r, err := b.lim.CheckN(b.ctx, b.pool, p.name, p.key, n, &ratelimit.LimitOpts{Config: p.cfg, Reserve: true})
					require.NoError(t, err)
					out = append(out, r)
				}
			}
		}
		return out
	}
	before := answers()
	rowsBefore := testdb.CountRows(t, b.pool)

	b.clock.Set(pruneAt)
	// fws with a different Start: its row is off the new grid, so it must stay.
	shifted := fws
	shifted.Start = t0.Add(10 * time.Second)
	n, err := b.lim.Prune(b.ctx, b.pool, "fws", &ratelimit.PruneOpts{Config: &shifted})
	require.NoError(t, err)
	require.Zero(t, n, "an off-grid fixed window row was pruned")
	_, found := testdb.RowVersion(t, b.pool, "fws", "a", 0)
	require.True(t, found)

	deleted := int64(0)
	for _, name := range []string{"tb", "fw", "fws", "sh"} {
		n, err := b.lim.Prune(b.ctx, b.pool, name, &ratelimit.PruneOpts{BatchSize: 1})
		require.NoError(t, err)
		deleted += n
	}
	// Pruned: tb/refilled, fw/lastWindow, fws/a and the two shard rows of sh/k.
	require.Equal(t, int64(5), deleted)
	require.Equal(t, rowsBefore-5, testdb.CountRows(t, b.pool))
	for _, kept := range []struct {
		name, key string
		shard     int
	}{{"tb", "partial", 0}, {"tb", "debt", 0}, {"fws", "b", 0}, {"sh", "busy", 0}} {
		_, found := testdb.RowVersion(t, b.pool, kept.name, kept.key, kept.shard)
		require.True(t, found, "%s/%s was pruned but is not full", kept.name, kept.key)
	}
	require.Equal(t, before, answers(), "pruning changed a future decision")
}

// docs/spec.md §10: rows of shards ≥ Shards are left to Reset, full as they are; and §6: State,
// read with those Shards, ignores them, TS included (zero: no configured shard has a row).
func TestPruneLeavesShardsBeyondShards(t *testing.T) {
	t.Parallel()
	four := ratelimit.Config{Rate: 8, Period: time.Second, Shards: 4} // 2 per shard
	two := four
	two.Shards = 2
	b := setup(t, map[string]ratelimit.Config{"sh": four})
	ratelimit.SetShardPicker(b.lim, func(int) (int, int) { return 2, 3 })
	r, err := b.lim.LimitN(b.ctx, b.pool, "sh", "k", 4, nil) // both picks charged, to 0
	require.NoError(t, err)
	require.Equal(t, []int{2, 3}, r.Shards)
	b.clock.Set(t0.Add(time.Hour)) // full again

	n, err := b.lim.Prune(b.ctx, b.pool, "sh", &ratelimit.PruneOpts{Config: &two})
	require.NoError(t, err)
	require.Zero(t, n, "Prune with 2 shards deleted rows of shards 2 and 3")
	require.Equal(t, 2, testdb.CountRows(t, b.pool))
	st, err := b.lim.State(b.ctx, b.pool, "sh", "k", &ratelimit.LimitOpts{Config: &two})
	require.NoError(t, err)
	require.Equal(t, []float64{4, 4}, st.Shards)
	require.True(t, st.TS.IsZero(), "TS %v from a shard beyond Shards", st.TS)

	n, err = b.lim.Prune(b.ctx, b.pool, "sh", nil)
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "with 4 shards both rows are prunable")
}

// PruneAll prunes every registered limit and reports the rows deleted per limit.
// A BatchSize beyond what the statement's LIMIT carries (an int32) prunes as math.MaxInt32 does:
// before, 1<<32 wrapped to LIMIT 0 and pruned nothing, 1<<31 to a negative LIMIT and failed.
func TestPruneHugeBatchSize(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"tb": {Rate: 10, Period: time.Second}})
	for _, size := range []int{1 << 32, 1 << 31, math.MaxInt} {
		b.clock.Set(t0)
		for _, k := range []string{"a", "b", "c"} {
			_, err := b.lim.Limit(b.ctx, b.pool, "tb", k, nil)
			require.NoError(t, err)
		}
		b.clock.Set(t0.Add(time.Hour)) // every row full again: all three prunable
		n, err := b.lim.Prune(b.ctx, b.pool, "tb", &ratelimit.PruneOpts{BatchSize: size})
		require.NoError(t, err, "BatchSize %d", size)
		require.EqualValues(t, 3, n, "BatchSize %d", size)
	}
}

func TestPruneAll(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{
		"tb":   {Rate: 10, Period: time.Second},
		"fw":   {Kind: ratelimit.FixedWindow, Rate: 5, Period: time.Minute, Start: t0},
		"sh":   {Rate: 8, Period: time.Second, Shards: 4},
		"idle": {Rate: 1, Period: time.Second},
	})
	ratelimit.SetShardPicker(b.lim, func(int) (int, int) { return 0, 1 })
	take := func(at time.Time, name, key string, n float64) {
		t.Helper()
		b.clock.Set(at)
		r, err := b.lim.LimitN(b.ctx, b.pool, name, key, n, nil)
		require.NoError(t, err)
		require.True(t, r.OK)
	}
	take(t0, "tb", "a", 3)
	take(t0, "tb", "b", 3)
	take(t0.Add(time.Minute+9900*ms), "tb", "c", 10) // 1 token at the prune: kept
	take(t0, "fw", "a", 5)
	take(t0, "sh", "k", 3) // shards 0 and 1
	require.Equal(t, 6, testdb.CountRows(t, b.pool))

	b.clock.Set(t0.Add(time.Minute + 10*time.Second))
	got, err := b.lim.PruneAll(b.ctx, b.pool, &ratelimit.PruneOpts{BatchSize: 1})
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"tb": 2, "fw": 1, "sh": 2, "idle": 0}, got)
	require.Equal(t, 1, testdb.CountRows(t, b.pool))

	got, err = b.lim.PruneAll(b.ctx, b.pool, nil)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"tb": 0, "fw": 0, "sh": 0, "idle": 0}, got)

	_, err = b.lim.PruneAll(b.ctx, b.pool, &ratelimit.PruneOpts{Config: &ratelimit.Config{Rate: 1, Period: time.Second}})
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
	_, err = b.lim.PruneAll(b.ctx, nil, nil)
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
}

// docs/spec.md §1 and §10: on the database's clock a decision reads the clock when its statement
// starts, and may reach a row only after a lock wait. A Prune that read the clock later, found the
// row full and deleted it meanwhile, is ordered before the decision, which creates the row again:
// it is stamped at the clock read when it is created, not at the decision's earlier reading, else
// the row would be charged as full at an instant it was not, and refill from then (R at 5/s was
// charged to 0, read by the decision when it held about 1, and pruned once full; stamped at the
// decision's reading, it was left at 9 refilling from then, some 9 tokens made up).
func TestPruneBesideADecisionThatReadItsClockFirst(t *testing.T) {
	t.Parallel()
	b := setupDB(t, nil, map[string]ratelimit.Config{
		"a": {Rate: 10, Period: time.Hour},
		"r": {Rate: 10, Period: 2 * time.Second},
	})
	ctx := b.ctx
	_, err := b.lim.Limit(ctx, b.pool, "a", "k", nil)
	require.NoError(t, err)
	r0 := emptyRAndLetItHoldOne(t, b)
	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback(context.Background()) })
	testdb.LockRow(t, holder, "a", "k", 0)

	conn := testdb.Conn(t, b.pool)
	done := async(func() (ratelimit.ManyResult, error) {
		return b.lim.LimitMany(ctx, conn, []ratelimit.Request{{Name: "a", Key: "k"}, {Name: "r", Key: "k"}}, nil)
	})
	eventually(t, "LimitMany waits for row a", func() bool { return testdb.LockWait(t, b.pool, conn.PgConn().PID()) != "" })
	pruneRBesideTheWaiter(t, b, r0, holder, func() (bool, time.Time) {
		m := <-done
		require.NoError(t, m.err)
		return m.res.OK, m.res.Time
	})
}

// emptyRAndLetItHoldOne charges limit "r" (10 per 2 s) to 0 and waits until it holds 1 again:
// full again 2 s after the returned result's Time.
func emptyRAndLetItHoldOne(t *testing.T, b *testBundle) ratelimit.Result {
	t.Helper()
	r0, err := b.lim.LimitN(b.ctx, b.pool, "r", "k", 10, nil)
	require.NoError(t, err)
	require.True(t, r0.OK)
	eventually(t, "R holds 1", func() bool {
		st, err := b.lim.State(b.ctx, b.pool, "r", "k", nil)
		require.NoError(t, err)
		return st.Value >= 1
	})
	return r0
}

// pruneRBesideTheWaiter waits until R (emptied by r0) is full again, prunes it while a decision
// that read its clock before (and charges R 1) waits on holder, ends holder, and checks that R was
// charged as full only at a reading after the prune's, the decision's Result.Time (decided: its
// OK and Time).
func pruneRBesideTheWaiter(t *testing.T, b *testBundle, r0 ratelimit.Result, holder pgx.Tx, decided func() (bool, time.Time)) {
	t.Helper()
	eventually(t, "R full", func() bool {
		st, err := b.lim.State(b.ctx, b.pool, "r", "k", nil)
		require.NoError(t, err)
		return st.Value == 10
	})
	n, err := b.lim.Prune(b.ctx, b.pool, "r", nil)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.NoError(t, holder.Rollback(b.ctx))
	ok, at := decided()
	require.True(t, ok)
	full := r0.Time.Add(2 * time.Second)
	value, ts, found := testdb.StoredRow(t, b.pool, "r", "k", 0)
	require.True(t, found)
	require.Equal(t, 9.0, value, "R full, then charged 1")
	require.False(t, time.UnixMicro(ts).Before(full), "R stamped %v after its charge, before it was full again", time.UnixMicro(ts).Sub(r0.Time))
	require.Equal(t, at.UnixMicro(), ts, "Result.Time is the reading R was charged at")
}

// docs/spec.md §1, §2: a decision that creates one shard of a sharded limit and charges it together
// with the other, existing shard, after waiting for that shard's lock, decides both at one
// instant. Deciding the created shard at a reading taken after the wait and the other at the
// statement's first one split the tokens between rows stamped at different instants: the existing
// shard, full all along, was left refilling from the earlier reading, tokens it had never lacked
// (a 10-token, 2-shard limit charged 8 with both shards full must hold 2 after it, not up to 6).
func TestChargeOfACreatedShardAndAnExistingOneAfterAWait(t *testing.T) {
	t.Parallel()
	b := setupDB(t, nil, map[string]ratelimit.Config{
		"sh": {Rate: 10, Period: 100 * time.Millisecond, Shards: 2},
	})
	ctx := b.ctx
	// Shard 0 full (stamped as a missing row is), shard 1 missing.
	_, err := b.pool.Exec(ctx, "INSERT INTO txlimit_state (name, key, shard, value, ts) VALUES ('sh', 'k', 0, 5, 0)")
	require.NoError(t, err)
	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback(context.Background()) })
	testdb.LockRow(t, holder, "sh", "k", 0)

	conn := testdb.Conn(t, b.pool)
	done := async(func() (ratelimit.Result, error) { return b.lim.LimitN(ctx, conn, "sh", "k", 8, nil) })
	eventually(t, "LimitN waits for shard 0", func() bool { return testdb.LockWait(t, b.pool, conn.PgConn().PID()) != "" })
	require.NoError(t, holder.Rollback(ctx))
	r := <-done
	require.NoError(t, r.err)
	require.True(t, r.res.OK)
	require.Equal(t, []int{0, 1}, r.res.Shards)
	v0, ts0, found0 := testdb.StoredRow(t, b.pool, "sh", "k", 0)
	v1, ts1, found1 := testdb.StoredRow(t, b.pool, "sh", "k", 1)
	require.True(t, found0 && found1)
	require.Equal(t, 1.0, v0)
	require.Equal(t, 1.0, v1)
	// The tokens both rows hold at the later ts (5 per 100 ms per shard: 0.00005 per µs).
	at := max(ts0, ts1)
	held := min(v0+float64(at-ts0)*0.00005, 5) + min(v1+float64(at-ts1)*0.00005, 5)
	require.Equal(t, 2.0, held, "shards stamped %d µs apart", ts1-ts0)
	require.Equal(t, r.res.Time.UnixMicro(), at, "Result.Time is the instant the rows were charged at")
}

// docs/spec.md §1 and §10, for a lone Limit on an unsharded limit (DecideOneRow): it read the
// clock, found its row granting and queued on the row's advisory lock; a Prune that read the
// clock later, found the row full and deleted it meanwhile. The row the Limit creates is decided
// at a reading taken after, not charged as full at the Limit's first reading, when it held about 1.
func TestPruneBesideALoneLimitQueuedOnItsRow(t *testing.T) {
	t.Parallel()
	b := setupDB(t, nil, map[string]ratelimit.Config{"r": {Rate: 10, Period: 2 * time.Second}})
	ctx := b.ctx
	r0 := emptyRAndLetItHoldOne(t, b)
	holder, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback(context.Background()) })
	_, err = holder.Exec(ctx, "SELECT pg_advisory_xact_lock($1::bigint # ('txlimit_state'::regclass::oid::bigint << 20))",
		ratelimit.QueueKey("r", "k"))
	require.NoError(t, err)

	conn := testdb.Conn(t, b.pool)
	done := async(func() (ratelimit.Result, error) { return b.lim.Limit(ctx, conn, "r", "k", nil) })
	eventually(t, "Limit queues on R", func() bool { return testdb.LockWait(t, b.pool, conn.PgConn().PID()) == "advisory" })
	pruneRBesideTheWaiter(t, b, r0, holder, func() (bool, time.Time) {
		r := <-done
		require.NoError(t, r.err)
		return r.res.OK, r.res.Time
	})
}
