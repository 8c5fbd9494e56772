package ratelimit_test

// The shapes of the engine's road that FuzzModel cannot take: it decides on one connection at a
// time, so no candidate shard is ever taken by another transaction (txlimit_steer), no row is held
// by one (txlimit_decide_one_v1's SKIP LOCKED), no steering wait times out (txlimit_await_shard).
// Each test here holds such a lock in a second transaction, makes one call, and checks its answer
// and the rows it leaves against the reference model (model_test.go), evaluated on the rows the
// call was documented to decide on (the package doc, "Shards").

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// contention is a limiter on a fresh schema, its clock fixed at t0 and its shard picks fixed.
type contention struct {
	t    *testing.T
	ctx  context.Context
	b    *testBundle
	cfg  ratelimit.Config
	lim  modelLimit
	base int64 // ShardLockBase("s", "k")
}

// newContention returns a contention on cfg as the only limit, "s", whose picks for key "k" are
// shards 0 and 1, and stores the shards' values, all stamped t0.
func newContention(t *testing.T, cfg ratelimit.Config, values map[int]float64) *contention {
	t.Helper()
	bundle := newBundle(t, &testdb.Options{MaxConns: 4}, &ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"s": cfg}, Now: func() time.Time { return t0 },
	})
	ratelimit.SetShardPicker(bundle.lim, func(int) (int, int) { return 0, 1 })
	m, err := modelResolve("s", "k", &cfg)
	require.NoError(t, err)
	c := &contention{t: t, ctx: bundle.ctx, b: bundle, cfg: cfg, lim: m, base: ratelimit.ShardLockBase("s", "k")}
	c.rows(values)
	return c
}

// candidatesTaken is newContention on three shards of 5 (15/s) that may be reserved down to -15,
// with the steering locks of the shards held taken by another transaction, and the model of the
// rows stored.
func candidatesTaken(t *testing.T, values map[int]float64, held ...int) (*contention, *model) {
	t.Helper()
	c := newContention(t, ratelimit.Config{Rate: 15, Period: time.Second, Shards: 3, MaxReserved: 15}, values)
	c.holdSteering(held...)
	return c, c.model()
}

// rows stores the shards' values, all stamped t0.
func (c *contention) rows(values map[int]float64) {
	c.t.Helper()
	for sh, v := range values {
		_, err := c.b.pool.Exec(c.ctx, `INSERT INTO txlimit_state (name, key, shard, value, ts) VALUES ('s', 'k', $1, $2, $3)`,
			sh, v, t0.UnixMicro())
		require.NoError(c.t, err)
	}
}

// model returns the model holding the table's rows.
func (c *contention) model() *model {
	c.t.Helper()
	md := newModel()
	rs, err := c.b.pool.Query(c.ctx, `SELECT name, key, shard, value, ts FROM txlimit_state`)
	require.NoError(c.t, err)
	defer rs.Close()
	for rs.Next() {
		var k modelRowKey
		var r modelRow
		require.NoError(c.t, rs.Scan(&k.name, &k.key, &k.shard, &r.value, &r.ts))
		md.rows[k] = r
	}
	require.NoError(c.t, rs.Err())
	return md
}

// same requires the library's result and rows to be the model's.
func (c *contention) same(got ratelimit.Result, want modelResult, md *model) {
	c.t.Helper()
	require.Equal(c.t, want.OK, got.OK, "OK")
	require.Equal(c.t, want.Reserved, got.Reserved, "Reserved")
	require.Equal(c.t, want.Value, got.Value, "Value")
	require.Equal(c.t, want.Shards, got.Shards, "Shards")
	require.True(c.t, sameTime(got.RetryAt, want.RetryAt), "RetryAt %v, want %d", got.RetryAt, want.RetryAt)
	require.True(c.t, sameTime(got.Time, want.Time), "Time")
	require.Equal(c.t, md.rows, c.model().rows, "the rows left")
}

// holdSteering takes the steering locks of shards in a transaction of its own, held until the
// test ends.
func (c *contention) holdSteering(shards ...int) pgx.Tx {
	c.t.Helper()
	y, err := c.b.pool.Begin(c.ctx)
	require.NoError(c.t, err)
	c.t.Cleanup(func() { _ = y.Rollback(context.Background()) })
	for _, sh := range shards {
		testdb.HoldSteerLock(c.t, y, c.base, sh)
	}
	return y
}

// A candidate whose steering lock another transaction holds is passed over: the call decides on
// the next candidate and the one after it, as the model does with those two as its picks. Three
// shards of 5 (15/s), at 5 (missing), 1 and 4; picks (0, 1), shard 0 taken: the call for 3
// decides on (1, 2) and charges shard 2 alone (1 left), Value 1 + 1. On the picks (0, 1) it would
// have charged shard 0.
func TestModelSteersPastATakenCandidate(t *testing.T) {
	t.Parallel()
	c, md := candidatesTaken(t, map[int]float64{1: 1, 2: 4}, 0)
	want := md.decide(t0.UnixMicro(), []modelReq{{lim: c.lim, count: 3, a: 1, b: 2}}, false).Results[0]
	got, err := c.b.lim.LimitN(c.ctx, c.b.pool, "s", "k", 3, nil)
	require.NoError(t, err)
	require.Equal(t, []int{2}, want.Shards)
	c.same(got, want, md)
}

// Every candidate taken under READ COMMITTED, a plan that grants and no transaction ID: the call
// waits for its first candidate's steering lock for the transaction's own lock_timeout when that
// is under 100 ms (20 ms here), goes on without it when the wait times out, plans again on its
// picks and decides as the model does on them; the transaction's lock_timeout is left as it was.
func TestModelSteeringWaitTimesOutThenDecidesOnThePicks(t *testing.T) {
	t.Parallel()
	c, md := candidatesTaken(t, map[int]float64{0: 4, 1: 2}, 0, 1, 2)
	want := md.decide(t0.UnixMicro(), []modelReq{{lim: c.lim, count: 3, a: 0, b: 1}}, false).Results[0]
	x, err := c.b.pool.Begin(c.ctx)
	require.NoError(t, err)
	defer func() { _ = x.Rollback(c.ctx) }()
	_, err = x.Exec(c.ctx, "SET LOCAL lock_timeout = '20ms'")
	require.NoError(t, err)
	start := time.Now()
	got, err := c.b.lim.LimitN(c.ctx, x, "s", "k", 3, nil)
	require.NoError(t, err)
	require.GreaterOrEqual(t, time.Since(start), 20*time.Millisecond, "the call waits for the steering lock")
	var lt string
	require.NoError(t, x.QueryRow(c.ctx, "SHOW lock_timeout").Scan(&lt))
	require.Equal(t, "20ms", lt)
	require.NoError(t, x.Commit(c.ctx))
	require.Equal(t, []int{0}, want.Shards)
	c.same(got, want, md)
}

// Every candidate taken under SERIALIZABLE: a *BusyError at once, and nothing written.
func TestModelEveryCandidateTakenUnderSnapshotIsBusy(t *testing.T) {
	t.Parallel()
	c, md := candidatesTaken(t, map[int]float64{0: 4, 1: 2}, 0, 1, 2)
	x, err := c.b.pool.BeginTx(c.ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	require.NoError(t, err)
	defer func() { _ = x.Rollback(c.ctx) }()
	_, err = c.b.lim.LimitN(c.ctx, x, "s", "k", 3, nil)
	var busy *ratelimit.BusyError
	require.True(t, errors.As(err, &busy), "got %v, want a *BusyError", err)
	require.NoError(t, x.Rollback(c.ctx))
	require.Equal(t, md.rows, c.model().rows, "nothing written")
}

// The pick the rule charges alone is held by another transaction (its row locked, its steering
// lock free): the call charges its other pick instead, which holds count alone (the package doc,
// "Shards"). Two shards of 5 (10/s) at 5 and 4, picks (0, 1), a call for 3: the model charges
// shard 0; with shard 0 held, shard 1 is charged alone, to 1, and the answer is the model's
// arithmetic on that charge: Value 1 + 5, Shards [1].
func TestModelHeldPickChargesTheOther(t *testing.T) {
	t.Parallel()
	c := newContention(t, ratelimit.Config{Rate: 10, Period: time.Second, Shards: 2, MaxReserved: 10}, map[int]float64{0: 5, 1: 4})
	y, err := c.b.pool.Begin(c.ctx)
	require.NoError(t, err)
	defer func() { _ = y.Rollback(c.ctx) }()
	testdb.LockRow(t, y, "s", "k", 0)
	md := c.model()
	now := t0.UnixMicro()
	free := md.decide(now, []modelReq{{lim: c.lim, count: 3, a: 0, b: 1}}, true).Results[0]
	require.Equal(t, []int{0}, free.Shards, "unheld, shard 0 is charged")
	// Shard 1 charged alone: the model's primitives, as txlimit_charge's fixed charge 2.
	la, _ := c.lim.level(md.rows[modelRowKey{"s", "k", 0}], now)
	lb, tsB := c.lim.level(md.rows[modelRowKey{"s", "k", 1}], now)
	eb := left(1, 2, la, lb, 3)
	require.True(t, grantedBy(2, left(0, 2, la, lb, 3), eb, 0))
	want := modelResult{OK: true, RetryAt: modelNoTime, TS: modelNoTime, Value: eb + la, Shards: []int{1}, Time: now}
	md.rows[modelRowKey{"s", "k", 1}] = modelRow{eb, tsB}
	got, err := c.b.lim.LimitN(c.ctx, c.b.pool, "s", "k", 3, nil)
	require.NoError(t, err)
	require.NoError(t, y.Rollback(c.ctx))
	c.same(got, want, md)
}
