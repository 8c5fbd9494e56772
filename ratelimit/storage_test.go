package ratelimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// The state table is updated on every granted decision, so updates must be HOT (heap-only
// tuples: no index entry written, no index bloat). Nothing that changes is indexed and pages keep
// free space (fillfactor 70), so nearly every update of a hot row should be HOT.
func TestUpdatesAreHOT(t *testing.T) {
	t.Parallel()
	conn := testdb.Conn(t, testdb.Pool(t, nil))
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: map[string]ratelimit.Config{
		"l": {Rate: 1e6, Period: time.Second},
		"s": {Rate: 1e6, Period: time.Second, Shards: 4},
	}})
	require.NoError(t, err)
	ctx := context.Background()
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
