package ratelimit_test

// Review r3: the operations other than deciding (State, Credit, Reset, OutOfDebtAt, Prune). Each
// test here failed on the code it was written against (main at 87b982e) and passes once its
// finding is fixed.

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// Under SERIALIZABLE, State, Credit and Reset read txlimit_state with a plan of their own: on a
// small, analyzed table a sequential scan, which takes a relation-level SIRead lock. Two
// SERIALIZABLE transactions that each Credit (or Reset, or read the State of and then Limit) a
// different key then form a read/write cycle and the second commit fails with 40001, where two
// decisions on different keys both commit (docs/spec.md §7: decisions reach rows by primary-key
// probes "so under SERIALIZABLE a decision holds tuple or page predicate locks only, never a
// relation-level one, even on a table of one row"). The scheduler credits inside the caller's
// transaction (Settlement, Cancel), so settling two unrelated jobs in SERIALIZABLE conflicts.
func TestR3SerializableOpsOnDifferentKeysBothCommit(t *testing.T) {
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

// docs/spec.md §6: "With shards the tokens go to the emptiest shards first", and CreditResult.Value
// is "the number of tokens available after the credit, summed over every shard". Under READ
// COMMITTED a Credit that waits for a shard row held by a decision re-reads that row as the
// decision left it, but a shard row the decision created is not in the Credit's snapshot and counts
// as full: the Credit acts after the decision on one shard and before it on the other. Here
// 10/s over 2 shards (5 each, MaxReserved 5 each): shard 0 at 4, a transaction reserves 13 over
// shards 0 and 1 (missing: 5), leaving each at (4 + 5 − 13)/2 = −2, while a Credit of 4 waits.
// In either serial order the answers agree with each other: Credit first gives 1 (shard 0 to 5,
// Value 10) and the reservation then leaves both at −1.5 (the limit holds −3); Credit second gives
// 4 to the emptiest (a tie: shard 0, to 2), Value 2 − 2 = 0, and the limit holds 0. The Credit
// reports Value 7 (2 + a "full" 5) while the limit holds 0.
func TestR3CreditRacingADecisionReportsTheLimit(t *testing.T) {
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
	require.True(t, r.Reserved)
	require.Equal(t, []int{0, 1}, r.Shards)

	conn := testdb.Conn(t, b.pool)
	type credit struct {
		res ratelimit.CreditResult
		err error
	}
	done := make(chan credit, 1)
	go func() {
		c, err := b.lim.Credit(ctx, conn, "sh", "k", 4, nil)
		done <- credit{c, err}
	}()
	eventually(t, "Credit waits for shard 0", func() bool { return testdb.LockWait(t, b.pool, conn.PgConn().PID()) != "" })
	require.NoError(t, tx.Commit(ctx))
	c := <-done
	require.NoError(t, c.err)
	st, err := b.lim.State(ctx, b.pool, "sh", "k", nil)
	require.NoError(t, err)
	type outcome struct{ Credited, Value, Holds float64 }
	got := outcome{c.res.Credited, c.res.Value, st.Value}
	require.Contains(t, []outcome{{1, 10, -3}, {4, 0, 0}}, got,
		"Credit(4) racing the reservation: Credited, CreditResult.Value and the State after it (shards %v)", st.Shards)
}

// OutOfDebtAt's documentation: "Bad input (... a from or TS more than 2^62 µs, about 146,000 years,
// from the Unix epoch) is an error matching ErrInvalid, with no SQL run", and docs/spec.md §5: "all
// time arithmetic is bounded for every input the validation accepts". A from and a TS each within
// 2^62 µs of the epoch but on opposite sides are accepted, and the SQL then subtracts them
// (txlimit_level's now − ts) out of a bigint. Either answer (the first µs the row is out of debt,
// at most from + 2^61 µs) or an ErrInvalid error is acceptable; a database error is not.
func TestR3OutOfDebtAtFarApartTimes(t *testing.T) {
	t.Parallel()
	b := setup(t, map[string]ratelimit.Config{"tok": {Rate: 10, Period: time.Second}})
	for _, c := range []struct {
		from, ts time.Time
		want     time.Time
	}{
		// A row at −1 stamped 2^62 µs before the epoch has refilled long before from: from itself.
		{time.UnixMicro(1 << 62), time.UnixMicro(-(1 << 62)), time.UnixMicro(1 << 62)},
		// A row at −1 stamped 2^62 µs after the epoch refills from its ts on: beyond the bound
		// from + 2^61 µs, which is the answer.
		{time.UnixMicro(-(1 << 62)), time.UnixMicro(1 << 62), time.UnixMicro(-(1 << 62) + (1 << 61))},
	} {
		got, err := b.lim.OutOfDebtAt(b.ctx, b.pool, c.from, []ratelimit.Row{{Name: "tok", Value: -1, TS: c.ts}})
		if err != nil {
			require.ErrorIs(t, err, ratelimit.ErrInvalid, "from %d µs, TS %d µs: accepted, then failed in the database", c.from.UnixMicro(), c.ts.UnixMicro())
			continue
		}
		require.Len(t, got, 1)
		require.True(t, got[0].Equal(c.want), "from %d µs, TS %d µs: got %d µs, want %d µs", c.from.UnixMicro(), c.ts.UnixMicro(), got[0].UnixMicro(), c.want.UnixMicro())
	}
}
