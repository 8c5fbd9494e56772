package scheduler_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/scheduler"
)

func TestJitterFor(t *testing.T) {
	t.Parallel()
	const max = time.Second
	require.Zero(t, scheduler.JitterFor("a", 0))
	require.Zero(t, scheduler.JitterFor("a", -time.Second))

	// Bounded, deterministic, spread evenly: each tenth of [0, max) gets about a tenth of 10,000
	// identities.
	var buckets [10]int
	for i := range 10_000 {
		id := fmt.Sprintf("user-%d", i)
		j := scheduler.JitterFor(id, max)
		require.GreaterOrEqual(t, j, time.Duration(0))
		require.Less(t, j, max)
		require.Zero(t, j%time.Microsecond, "microsecond precision, as Postgres stores it")
		require.Equal(t, j, scheduler.JitterFor(id, max))
		buckets[j*10/max]++
	}
	for i, n := range buckets {
		require.InDelta(t, 1000, n, 150, "tenth %d", i)
	}
}
