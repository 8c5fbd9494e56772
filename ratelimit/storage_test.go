package ratelimit_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// The state table is updated on every granted decision, so updates must be HOT (heap-only
// tuples: no index entry written, no index bloat). Nothing that changes is indexed and pages keep
// free space (fillfactor 70), so nearly every update of a hot row should be HOT.
func TestUpdatesAreHOT(t *testing.T) {
	t.Parallel()
	b := setupDB(t, nil, map[string]ratelimit.Config{
		"l": {Rate: 1e6, Period: time.Second},
		"s": {Rate: 1e6, Period: time.Second, Shards: 4},
	})
	ctx, conn, lim := b.ctx, testdb.Conn(t, b.pool), b.lim
	for i := 0; i < 300; i++ {
		_, err := lim.Limit(ctx, conn, "l", "hot", nil)
		require.NoError(t, err)
		_, err = lim.Limit(ctx, conn, "s", "hot", nil)
		require.NoError(t, err)
	}
	updates, hot := testdb.UpdateCounts(t, conn)
	t.Logf("%d updates, %d HOT (%.1f%%)", updates, hot, 100*float64(hot)/float64(updates))
	require.GreaterOrEqual(t, updates, int64(590))
	require.GreaterOrEqual(t, float64(hot), 0.9*float64(updates), "updates are not HOT")
}

// oneAndSharded is setupDB of two limits of 100 a second: "one", on one row, and "sharded", on
// the given number of shards.
func oneAndSharded(t *testing.T, shards int) *testBundle {
	t.Helper()
	return setupDB(t, nil, map[string]ratelimit.Config{
		"one":     {Rate: 100, Period: time.Second},
		"sharded": {Rate: 100, Period: time.Second, Shards: shards},
	})
}

// Under SERIALIZABLE a sequential scan takes a relation-level predicate lock, which makes every
// decision conflict with every other write to the table (and sharding useless). Even on a table of
// a few hot limits, with real statistics, decisions must look rows up by primary key (the decision
// function runs with sequential and bitmap scans off); and so on a table of many rows.
func TestSerializableDecisionsTakeNoRelationLock(t *testing.T) {
	t.Parallel()
	b := oneAndSharded(t, 16)
	pool, lim := b.pool, b.lim
	ctx := context.Background()
	for i := 0; i < 40; i++ { // create the rows, then let the planner see how few there are
		_, err := lim.Limit(ctx, pool, "one", "", nil)
		require.NoError(t, err)
		_, err = lim.Limit(ctx, pool, "sharded", "", nil)
		require.NoError(t, err)
	}
	calls := map[string]func(tx pgx.Tx) error{
		"Limit":   func(tx pgx.Tx) error { _, err := lim.Limit(ctx, tx, "one", "", nil); return err },
		"sharded": func(tx pgx.Tx) error { _, err := lim.Limit(ctx, tx, "sharded", "", nil); return err },
		// 10 tokens: more than a shard holds (6.25), so both picks are read and charged.
		"sharded, both": func(tx pgx.Tx) error { _, err := lim.LimitN(ctx, tx, "sharded", "", 10, nil); return err },
		"LimitMany": func(tx pgx.Tx) error {
			_, err := lim.LimitMany(ctx, tx, []ratelimit.Request{{Name: "one"}, {Name: "sharded"}}, nil)
			return err
		},
		"Check":       func(tx pgx.Tx) error { _, err := lim.Check(ctx, tx, "sharded", "", nil); return err },
		"Check, both": func(tx pgx.Tx) error { _, err := lim.CheckN(ctx, tx, "sharded", "", 10, nil); return err },
	}
	// A table of a few rows, then of many (2,000 more keys of "one").
	for _, more := range []int{0, 2000} {
		_, err := pool.Exec(ctx, `INSERT INTO txlimit_state (name, key, shard, value, ts)
			SELECT 'one', 'filler' || g, 0, 50, 0 FROM generate_series(1, $1::int) g`, more)
		require.NoError(t, err)
		testdb.Analyze(t, pool)
		decisionsTakeNoRelationLock(t, pool, calls)
	}
}

// decisionsTakeNoRelationLock runs each call 8 times, each in a SERIALIZABLE transaction of its own
// on a fresh connection, and requires that it holds no relation-level predicate lock on
// txlimit_state and (but for LimitMany) no heap-page one.
func decisionsTakeNoRelationLock(t *testing.T, pool *pgxpool.Pool, calls map[string]func(tx pgx.Tx) error) {
	t.Helper()
	ctx := context.Background()
	for what, call := range calls {
		// A fresh connection each time, so each plans the statement against the current statistics.
		conn := testdb.Conn(t, pool)
		// One decision per transaction, 8 times: past the first custom plans, onto the cached
		// generic plan.
		for i := 0; i < 8; i++ {
			tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
			require.NoError(t, err)
			require.NoError(t, call(tx), what)
			require.Zero(t, testdb.RelationPredicateLocks(t, tx), "%s took a relation-level predicate lock", what)
			// A single-row decision reads one or two tuples: it must not end up holding the heap
			// page, which all 16 shards of the key share. (LimitMany here reads three rows of
			// one page, so Postgres may promote its locks; it is not checked.)
			if what != "LimitMany" {
				require.Zero(t, testdb.HeapPagePredicateLocks(t, tx), "%s took a heap-page predicate lock", what)
			}
			require.NoError(t, tx.Rollback(ctx))
		}
	}
}

// The smallest table there is: one row, analyzed, where a planner left to itself would scan. A
// SERIALIZABLE decision (and State, Credit, Reset) still probes the primary key (every statement the decision runs, read
// from auto_explain: a scan of the table may be planned only where it never runs) and holds no
// relation-level predicate lock.
func TestOneRowTableUsesThePrimaryKey(t *testing.T) {
	t.Parallel()
	b := oneAndSharded(t, 4)
	pool, lim := b.pool, b.lim
	ctx := context.Background()
	_, err := lim.Limit(ctx, pool, "one", "", nil)
	require.NoError(t, err)
	require.Equal(t, 1, testdb.CountRows(t, pool))
	testdb.Analyze(t, pool)
	conn, plans := testdb.PlanConn(t, pool)
	for _, call := range []func(tx pgx.Tx) error{
		func(tx pgx.Tx) error { _, err := lim.Limit(ctx, tx, "one", "", nil); return err },
		func(tx pgx.Tx) error { _, err := lim.Check(ctx, tx, "one", "", nil); return err },
		func(tx pgx.Tx) error {
			_, err := lim.LimitMany(ctx, tx, []ratelimit.Request{{Name: "one"}, {Name: "one", Key: "new"}}, nil)
			return err
		},
		func(tx pgx.Tx) error { _, err := lim.Limit(ctx, tx, "sharded", "", nil); return err },
		// 40 tokens of 4 shards of 25: both picks combined, by the road for lists.
		func(tx pgx.Tx) error { _, err := lim.LimitN(ctx, tx, "sharded", "", 40, nil); return err },
		func(tx pgx.Tx) error { _, err := lim.CheckN(ctx, tx, "sharded", "", 40, nil); return err },
		// The other operations on a row (functions with the same planner settings).
		func(tx pgx.Tx) error { _, err := lim.State(ctx, tx, "one", "", nil); return err },
		func(tx pgx.Tx) error { _, err := lim.Credit(ctx, tx, "one", "", 1, nil); return err },
		func(tx pgx.Tx) error { return lim.Reset(ctx, tx, "one", "") },
		func(tx pgx.Tx) error { _, err := lim.State(ctx, tx, "sharded", "", nil); return err },
		func(tx pgx.Tx) error { _, err := lim.Credit(ctx, tx, "sharded", "", 1, nil); return err },
		func(tx pgx.Tx) error { return lim.Reset(ctx, tx, "sharded", "") },
	} {
		for range 8 { // past the first custom plans, onto the cached generic ones
			tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
			require.NoError(t, err)
			plans()
			require.NoError(t, call(tx))
			got := plans()
			require.Zero(t, testdb.RelationPredicateLocks(t, tx), "a relation-level predicate lock")
			require.NoError(t, tx.Rollback(ctx))
			probes := 0
			for _, p := range got {
				for _, line := range strings.Split(p, "\n") {
					if strings.Contains(line, "Seq Scan on txlimit_state") || strings.Contains(line, "Bitmap") {
						require.Contains(t, line, "(never executed)", "a scan of the table ran:\n%s", p)
					}
					if strings.Contains(line, "txlimit_state_pkey") && !strings.Contains(line, "(never executed)") {
						probes++
					}
				}
			}
			require.Positive(t, probes, "no primary-key probe among the plans:\n%s", strings.Join(got, "\n"))
		}
	}
}

// Under SERIALIZABLE, State, Credit and Reset reach rows by primary-key probes, as decisions do
// (their functions run with sequential and bitmap scans off, docs/spec.md §7). As plain statements
// they were planned as sequential scans on a small, analyzed table and took a relation-level
// SIRead lock: two SERIALIZABLE transactions that each Credit (or Reset, or read the State of and
// then Limit) a different key formed a read/write cycle and the second commit failed with 40001,
// where two decisions on different keys both commit. The scheduler credits inside the caller's
// transaction (Settlement, Cancel), so settling two unrelated jobs in SERIALIZABLE conflicted.
func TestSerializableOpsOnDifferentKeysBothCommit(t *testing.T) {
	t.Parallel()
	b := setupDB(t, nil, map[string]ratelimit.Config{"one": {Rate: 100, Period: time.Second}})
	ctx, lim := b.ctx, b.lim
	ops := []struct {
		name string
		run  func(tx pgx.Tx, key string) error
	}{
		{"Limit", func(tx pgx.Tx, k string) error { _, err := lim.Limit(ctx, tx, "one", k, nil); return err }},
		{"Credit", func(tx pgx.Tx, k string) error { _, err := lim.Credit(ctx, tx, "one", k, 1, nil); return err }},
		{"Reset", func(tx pgx.Tx, k string) error { return lim.Reset(ctx, tx, "one", k) }},
		{"State+Limit", func(tx pgx.Tx, k string) error {
			if _, err := lim.State(ctx, tx, "one", k, nil); err != nil {
				return err
			}
			_, err := lim.Limit(ctx, tx, "one", k, nil)
			return err
		}},
	}
	for _, op := range ops {
		// Four keys at 50 of 100, analyzed: the planner sees a table of one page.
		_, err := b.pool.Exec(ctx, "DELETE FROM txlimit_state")
		require.NoError(t, err)
		for _, k := range []string{"a", "b", "c", "d"} {
			_, err := lim.LimitN(ctx, b.pool, "one", k, 50, nil)
			require.NoError(t, err)
		}
		testdb.Analyze(t, b.pool)
		connA, connB := testdb.Conn(t, b.pool), testdb.Conn(t, b.pool)
		txA, err := connA.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
		require.NoError(t, err)
		txB, err := connB.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
		require.NoError(t, err)
		require.NoError(t, op.run(txA, "a"), op.name)
		require.NoError(t, op.run(txB, "b"), op.name)
		relA, relB := testdb.RelationPredicateLocks(t, txA), testdb.RelationPredicateLocks(t, txB)
		errA, errB := txA.Commit(ctx), txB.Commit(ctx)
		if errA != nil || errB != nil {
			t.Errorf("%s on key a and on key b, each in a SERIALIZABLE transaction: commit a: %v; commit b: %v (relation-level predicate locks held: %d and %d)",
				op.name, errA, errB, relA, relB)
		}
	}
}
