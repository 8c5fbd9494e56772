package ratelimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// Review r1: sharded limits on a lone Limit/LimitN call, and the steering wait under READ
// COMMITTED (txlimit_steer, migrations/00003_txlimit_decide.sql).

// r1Slow is a sharded limit that refills so slowly (1 token per hour per shard) that a shard at 0
// refuses a Limit for the whole of a test: every call on it below is a plan denial, which per
// docs/spec.md §7 ("Denials are cheap") takes no lock and writes nothing.
var r1Slow = ratelimit.Config{Rate: 2, Period: time.Hour, Capacity: 4, Shards: 2}

// r1Empty creates the rows of both shards of (name, key) empty at shardT0.
func r1Empty(t *testing.T, e *shardEnv, name, key string) {
	t.Helper()
	_, err := e.pool.Exec(e.ctx, `INSERT INTO txlimit_state (name, key, shard, value, ts) VALUES ($1, $2, 0, 0, $3), ($1, $2, 1, 0, $3)`,
		name, key, shardT0.UnixMicro())
	require.NoError(t, err)
}

// r1Begin begins a READ COMMITTED transaction, rolled back when the test ends.
func r1Begin(t *testing.T, e *shardEnv) pgx.Tx {
	t.Helper()
	tx, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

// r1Refused makes a Limit on (name, key) in tx with picks pick, which the empty shards refuse, and
// checks that tx still has no transaction ID (it wrote and locked no row).
func r1Refused(t *testing.T, e *shardEnv, tx pgx.Tx, name, key string, pick [2]int) {
	t.Helper()
	e.set(shardT0, pick)
	r, err := e.lim.Limit(e.ctx, tx, name, key, nil)
	require.NoError(t, err)
	require.False(t, r.OK, "the empty shards refuse")
	var xid *int64
	require.NoError(t, tx.QueryRow(e.ctx, "SELECT pg_current_xact_id_if_assigned()::text::bigint").Scan(&xid))
	require.Nil(t, xid, "a refused call wrote or locked nothing")
}

type r1Answer struct {
	r   ratelimit.Result
	err error
}

// r1Limit runs Limit(name, key) in tx on a goroutine; when it fails, tx is rolled back there (so
// that what it held is let go, as a caller handling the error would).
func r1Limit(e *shardEnv, tx pgx.Tx, name, key string) <-chan r1Answer {
	ch := make(chan r1Answer, 1)
	go func() {
		r, err := e.lim.Limit(e.ctx, tx, name, key, nil)
		if err != nil {
			_ = tx.Rollback(context.Background())
		}
		ch <- r1Answer{r, err}
	}()
	return ch
}

// r1Wait returns the answer on ch, failing the test if none comes within a minute (a safety net
// only: every wait below is either answered at once or broken by Postgres's deadlock detector).
func r1Wait(t *testing.T, ch <-chan r1Answer) r1Answer {
	t.Helper()
	select {
	case a := <-ch:
		return a
	case <-time.After(time.Minute):
		t.Fatal("no answer within a minute")
		return r1Answer{}
	}
}

// Two READ COMMITTED transactions whose first calls were refused hold no row and no transaction ID,
// but they do hold the steering locks of the shards those calls steered to. Each then makes a
// Limit on the key the other one occupies: each finds every candidate taken and, having no
// transaction ID, waits for its first candidate's steering lock, which the other holds. Before
// 76c448c neither call could wait for an advisory lock and both were answered (refused) at once;
// now Postgres breaks the cycle with a deadlock error (40P01). docs/spec.md §7: a denial "takes no
// lock", "no deadlock between calls"; the package doc ("Shards") gives the reason a transaction
// that holds rows never waits for an advisory lock, "where it could close a deadlock with what it
// holds", but a transaction without rows holds steering locks and closes one the same way.
func TestReviewR1SteeringWaitDeadlocksTwoRefusedTransactions(t *testing.T) {
	t.Parallel()
	e := newShardEnv(t, map[string]ratelimit.Config{"s": r1Slow})
	e.pool = testdb.Pool(t, &testdb.Options{MaxConns: 6})
	r1Empty(t, e, "s", "a")
	r1Empty(t, e, "s", "b")

	// t1 is refused twice on key a (steered to shard 0, then to shard 1), t2 twice on key b.
	t1, t2 := r1Begin(t, e), r1Begin(t, e)
	r1Refused(t, e, t1, "s", "a", [2]int{0, 1})
	r1Refused(t, e, t1, "s", "a", [2]int{1, 0})
	r1Refused(t, e, t2, "s", "b", [2]int{0, 1})
	r1Refused(t, e, t2, "s", "b", [2]int{1, 0})

	// Each now asks for the other's key; both rows of both keys are free (and empty).
	e.set(shardT0, [2]int{0, 1})
	c1 := r1Limit(e, t1, "s", "b")
	// Not needed for the deadlock, only to make its order certain: t1 waits for t2 first.
	eventually(t, "t1's call waits for shard 0 of key b, or is answered",
		func() bool {
			return len(c1) > 0 || testdb.SteerWaiters(t, e.pool, ratelimit.ShardLockBase("s", "b"), 0) == 1
		})
	c2 := r1Limit(e, t2, "s", "a")

	a1, a2 := r1Wait(t, c1), r1Wait(t, c2)
	require.NoError(t, a1.err, "t1's Limit on key b (refused calls must not deadlock)")
	require.NoError(t, a2.err, "t2's Limit on key a (refused calls must not deadlock)")
	require.False(t, a1.r.OK)
	require.False(t, a2.r.OK)
}

// A call on the pool that the shards refuse, on rows that no transaction holds, is answered at
// once (docs/spec.md §7: "Denials are cheap. A group whose plan is a denial takes no lock"). Since
// 76c448c it is not when every candidate's steering lock is held, even by transactions that hold
// no row (here, two whose own calls were refused and which are still open): it waits for the
// first candidate's steering lock until that transaction ends, though that transaction will never
// change the shard (docs/sharding.md's reason, "it sleeps until that shard's holder commits,
// instead of waiting for the row", assumes the holder holds the row). A Batcher's batch of one
// does the same and holds up its lane meanwhile; a caller that makes the pool call while its own
// such transaction is open waits for itself until its context ends.
func TestReviewR1RefusedPoolCallWaitsForASteeringLockWhoseHolderHoldsNoRow(t *testing.T) {
	t.Parallel()
	for _, via := range []string{"pool", "batcher"} {
		t.Run(via, func(t *testing.T) {
			t.Parallel()
			e := newShardEnv(t, map[string]ratelimit.Config{"s": r1Slow})
			e.pool = testdb.Pool(t, &testdb.Options{MaxConns: 6})
			r1Empty(t, e, "s", "k")
			base := ratelimit.ShardLockBase("s", "k")
			limit := func() (ratelimit.Result, error) { return e.lim.Limit(e.ctx, e.pool, "s", "k", nil) }
			if via == "batcher" {
				b, err := ratelimit.NewBatcher(e.pool, e.lim, nil)
				require.NoError(t, err)
				t.Cleanup(b.Close)
				limit = func() (ratelimit.Result, error) { return b.Limit(e.ctx, "s", "k", nil) }
			}

			t1, t2 := r1Begin(t, e), r1Begin(t, e)
			r1Refused(t, e, t1, "s", "k", [2]int{0, 1}) // steered to shard 0
			r1Refused(t, e, t2, "s", "k", [2]int{0, 1}) // shard 0 taken: steered to shard 1

			e.set(shardT0, [2]int{0, 1})
			done := make(chan r1Answer, 1)
			go func() {
				r, err := limit()
				done <- r1Answer{r, err}
			}()
			var a r1Answer
			answered := false
			eventually(t, "the call is answered or waits for a steering lock", func() bool {
				select {
				case a = <-done:
					answered = true
					return true
				default:
					return testdb.SteerWaiters(t, e.pool, base, 0) > 0
				}
			})
			if !answered { // let it go, so that the goroutine ends
				require.NoError(t, t1.Rollback(e.ctx))
				require.NoError(t, t2.Rollback(e.ctx))
				a = r1Wait(t, done)
			}
			require.True(t, answered, "a call refused on free rows waited for the steering lock of a transaction that holds neither row (answer after it ended: ok %v, err %v)", a.r.OK, a.err)
			require.NoError(t, a.err)
			require.False(t, a.r.OK)
		})
	}
}

// Under SERIALIZABLE, steering passes over a stale shard but keeps the steering lock it took on it
// (a transaction-scoped advisory lock cannot be let go before the transaction ends), so a
// transaction that will never touch that shard marks it "being decided on" until it ends. Another
// SERIALIZABLE call whose snapshot sees the shard fine, its row free, then gets a *BusyError,
// which says "every candidate shard was being decided on by another transaction at that moment"
// (errors.go; spec §8: "when no candidate is left"); and a call on the pool waits for that lock.
func TestReviewR1StaleShardPassedOverStaysTaken(t *testing.T) {
	t.Parallel()
	e := newShardEnv(t, map[string]ratelimit.Config{"s": shardCfg(2)}) // each shard holds 2
	e.pool = testdb.Pool(t, &testdb.Options{MaxConns: 6})
	e.set(shardT0, [2]int{0, 1})
	r, err := e.lim.LimitN(e.ctx, e.pool, "s", "k", 3, nil) // creates both rows: [0.5 0.5]
	require.NoError(t, err)
	require.Equal(t, []int{0, 1}, r.Shards)
	e.set(shardAt(2), [2]int{0, 1}) // both full again

	// t1's snapshot is taken before shard 0 is charged on the pool: shard 0 is stale for t1, which
	// is steered to shard 1.
	t1, err := e.pool.BeginTx(e.ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	require.NoError(t, err)
	defer t1.Rollback(e.ctx)
	var one int
	require.NoError(t, t1.QueryRow(e.ctx, "SELECT 1").Scan(&one))
	r, err = e.lim.Limit(e.ctx, e.pool, "s", "k", nil)
	require.NoError(t, err)
	require.Equal(t, []int{0}, r.Shards)
	r, err = e.lim.Limit(e.ctx, t1, "s", "k", nil)
	require.NoError(t, err)
	require.Equal(t, []int{1}, r.Shards, "shard 0 is stale for t1")

	// t2 sees shard 0 as committed (1 token), and nobody holds its row: it should be granted there.
	t2, err := e.pool.BeginTx(e.ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	require.NoError(t, err)
	defer t2.Rollback(e.ctx)
	r, err = e.lim.Limit(e.ctx, t2, "s", "k", nil)
	require.NoError(t, err, "shard 0 is neither stale for t2 nor decided on by anyone")
	require.Equal(t, []int{0}, r.Shards)
}
