package ratelimit_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// PruneAll prunes every registered limit and reports the rows deleted per limit.
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
