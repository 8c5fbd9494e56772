package httplimit_test

// Review r2: each test here fails on the code as reviewed and passes once its finding is fixed.

import (
	"context"
	"math"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/dunglas/httpsfv"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/httplimit"
	"github.com/txlimit/txlimit/ratelimit"
)

// For a granted token bucket the package doc defines t as the seconds "until r grows by one", and
// r as ratelimit.Result.Value, which for a sharded limit covers only the one or two shards the
// call looked at (docs/spec.md §8), each refilling at Rate/Shards. reset() computes t with the
// whole Rate, so on a policy with Shards: 4 it tells clients to come back at least twice too soon
// (N/k times: 4× when one shard was looked at).
func TestReviewR2ShardedResetUsesTheShardsRate(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	cfg := ratelimit.Config{Rate: 8, Period: time.Minute, Capacity: 8, Shards: 4} // each shard: 2 per minute
	m, err := httplimit.New(&httplimit.Config{Secret: secret, Policies: []httplimit.Policy{{Name: "sharded", Config: cfg}}})
	require.NoError(t, err)
	res, err := b.limiter.LimitN(context.Background(), b.pool, "sharded", "k", 1, &ratelimit.LimitOpts{Config: &cfg})
	require.NoError(t, err)
	require.True(t, res.OK)
	w := httptest.NewRecorder()
	m.WriteHeaders(w, res)
	lim, err := httpsfv.UnmarshalList(w.Header().Values("RateLimit"))
	require.NoError(t, err)
	r, _ := lim[0].(httpsfv.Item).Params.Get("r")
	tt, _ := lim[0].(httpsfv.Item).Params.Get("t")
	// r grows by one when the shards looked at (at most two) have gained next − Value tokens, at
	// 2·Rate/Shards per Period at the fastest.
	need := float64(r.(int64)+1) - res.Value
	fastest := 2 * cfg.Rate / float64(cfg.Shards) / cfg.Period.Seconds() // tokens per second
	minT := int64(math.Ceil(need / fastest))
	require.GreaterOrEqual(t, tt.(int64), minT, "Value %v over the shards looked at (charged %v): r=%d, t=%d, but r cannot grow by one before %d s",
		res.Value, res.Shards, r, tt, minT)
}
