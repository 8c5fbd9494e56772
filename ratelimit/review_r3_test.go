package ratelimit_test

// Review r3: the operations other than deciding (State, Credit, Reset, OutOfDebtAt, Prune). Each
// test here failed on the code it was written against (main at 87b982e) and passes once its
// finding is fixed.

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/ratelimit"
)

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
