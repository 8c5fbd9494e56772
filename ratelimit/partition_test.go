package ratelimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// TestHashPartitionedTableChargesOnlyItsKey: docs/scaling.md tells users who outgrow one table to
// hash-partition txlimit_state by (name, key) in a migration of their own, and says nothing in the
// library changes. Every write must then still reach only the row it decided on: a row is found by
// its primary key, never by a physical address alone (ctid), which partitions repeat. Two keys of
// one sharded limit in two partitions, written alike (same picks, same clock), sit at the same
// ctids; a third call on the first key charges its shard 0 and nothing else.
func TestHashPartitionedTableChargesOnlyItsKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, &testdb.Options{MaxConns: 2})
	// The partitioning migration scaling.md describes: create the partitioned table, copy, swap.
	_, err := pool.Exec(ctx, `
		CREATE TABLE txlimit_state_p (LIKE txlimit_state INCLUDING DEFAULTS, PRIMARY KEY (name, key, shard))
			PARTITION BY HASH (name, key);
		CREATE TABLE txlimit_state_p0 PARTITION OF txlimit_state_p FOR VALUES WITH (MODULUS 2, REMAINDER 0);
		CREATE TABLE txlimit_state_p1 PARTITION OF txlimit_state_p FOR VALUES WITH (MODULUS 2, REMAINDER 1);
		INSERT INTO txlimit_state_p SELECT * FROM txlimit_state;
		DROP TABLE txlimit_state;
		ALTER TABLE txlimit_state_p RENAME TO txlimit_state`)
	require.NoError(t, err)

	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	lim, err := ratelimit.New(&ratelimit.LimiterConfig{
		Limits: map[string]ratelimit.Config{"hot": {Rate: 10, Period: time.Second, Shards: 2}}, // 5 a shard
		Now:    func() time.Time { return t0 },
	})
	require.NoError(t, err)
	var pick [2]int
	ratelimit.SetShardPicker(lim, func(int) (int, int) { return pick[0], pick[1] })

	// Two keys in different partitions.
	keys := []string{"k0"}
	for i := 1; len(keys) < 2; i++ {
		k := "k" + string(rune('0'+i))
		var same bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT satisfies_hash_partition('txlimit_state'::regclass, 2, 0, 'hot'::text COLLATE "C", $1::text COLLATE "C")
			= satisfies_hash_partition('txlimit_state'::regclass, 2, 0, 'hot'::text COLLATE "C", $2::text COLLATE "C")`, keys[0], k).Scan(&same))
		if !same {
			keys = append(keys, k)
		}
	}
	// Each key: shard 0 charged (a tie of two missing shards goes to the first pick), then shard 1
	// (the fuller of the two): both rows at 4, ts t0, at the same places in their partitions.
	for _, k := range keys {
		for _, p := range [][2]int{{0, 1}, {1, 0}} {
			pick = p
			res, err := lim.Limit(ctx, pool, "hot", k, nil)
			require.NoError(t, err)
			require.True(t, res.OK)
		}
	}
	rows, err := pool.Query(ctx, "SELECT key, shard, ctid::text, tableoid::regclass::text FROM txlimit_state ORDER BY key, shard")
	require.NoError(t, err)
	for rows.Next() {
		var k, ctid, part string
		var shard int
		require.NoError(t, rows.Scan(&k, &shard, &ctid, &part))
		t.Logf("%s shard %d at %s in %s", k, shard, ctid, part)
	}
	require.NoError(t, rows.Err())

	pick = [2]int{0, 1}
	res, err := lim.Limit(ctx, pool, "hot", keys[0], nil)
	require.NoError(t, err)
	require.True(t, res.OK)
	require.Equal(t, []int{0}, res.Shards)

	for _, c := range []struct {
		key  string
		want float64
	}{{keys[0], 7}, {keys[1], 8}} {
		st, err := lim.State(ctx, pool, "hot", c.key, nil)
		require.NoError(t, err)
		require.Equal(t, c.want, st.Value, "key %s: tokens left (a call on %s charged it?)", c.key, keys[0])
	}
}
