package ratelimit_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// R9-1. Two READ COMMITTED transactions that set their own lock_timeout (a minute, longer than
// Postgres's deadlock_timeout) and whose first calls were refused hold the steering locks of one
// key each and no transaction ID. After the keys are reset (full again), each makes a Limit on the
// key the other occupies: every candidate is taken, the plan grants and there is no transaction
// ID, so each waits for the other's steering lock. With the 100 ms bound both go on; with the
// transaction's own lock_timeout the wait closes a cycle that only Postgres's deadlock detector
// breaks, and one Limit fails with SQLSTATE 40P01, although neither call holds a row and steering
// is documented as a hint (docs/spec.md §7 "No deadlock between calls"; doc.go: the bound "keeps
// such waits from closing a deadlock that only Postgres's detector could break").
func TestR9SteeringWaitWithOwnLockTimeoutDeadlocks(t *testing.T) {
	t.Parallel()
	e := newShardEnv(t, map[string]ratelimit.Config{"s": slowShards})
	e.pool = testdb.Pool(t, &testdb.Options{MaxConns: 6})
	emptyShards(t, e, "s", "a")
	emptyShards(t, e, "s", "b")

	t1, t2 := beginRC(t, e), beginRC(t, e)
	_, err := t1.Exec(e.ctx, "SET LOCAL lock_timeout = '1min'")
	require.NoError(t, err)
	_, err = t2.Exec(e.ctx, "SET LOCAL lock_timeout = '1min'")
	require.NoError(t, err)
	refusedIn(t, e, t1, "s", "a", [2]int{0, 1})
	refusedIn(t, e, t1, "s", "a", [2]int{1, 0})
	refusedIn(t, e, t2, "s", "b", [2]int{0, 1})
	refusedIn(t, e, t2, "s", "b", [2]int{1, 0})
	// Both keys full again (neither transaction holds a row of them).
	require.NoError(t, e.lim.Reset(e.ctx, e.pool, "s", "a"))
	require.NoError(t, e.lim.Reset(e.ctx, e.pool, "s", "b"))

	e.set(shardT0, [2]int{0, 1})
	c1 := bAsync(rolledBackOnError(e, t1, "s", "b"))
	eventually(t, "t1's call waits for shard 0 of key b, or is answered",
		func() bool {
			return len(c1) > 0 || testdb.SteerWaiters(t, e.pool, ratelimit.ShardLockBase("s", "b"), 0) == 1
		})
	c2 := bAsync(rolledBackOnError(e, t2, "s", "a"))

	a1, a2 := bWait(t, c1), bWait(t, c2)
	require.NoError(t, a1.err, "t1's Limit on key b (a steering wait must not deadlock)")
	require.NoError(t, a2.err, "t2's Limit on key a (a steering wait must not deadlock)")
	require.True(t, a1.res.OK)
	require.True(t, a2.res.OK)
}
