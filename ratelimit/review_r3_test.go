package ratelimit_test

// Review r3: the operations other than deciding (State, Credit, Reset, OutOfDebtAt, Prune). Each
// test here failed on the code it was written against (main at 87b982e) and passes once its
// finding is fixed.

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

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
