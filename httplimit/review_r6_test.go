package httplimit_test

import (
	"context"
	"errors"
	"math"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/dunglas/httpsfv"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/httplimit"
	"github.com/txlimit/txlimit/ratelimit"
)

// Review r6. The package doc defines t, for a granted token bucket, as the seconds "until r grows
// by one", and for Shards N >= 2 says r covers the two shards the call looked at, "which refill at
// 2·Rate/N and are full at 2·Capacity/N, and t is computed from those". A full shard does not
// refill: on a fresh key (the first request of every client) the call looks at two full shards
// and charges one, so only that one refills, at Rate/N, and r cannot grow by one before twice the
// t that is sent. Rate 8/min over 4 shards (each 2/min, capacity 2): r=3 (1 + 2), t=15; after 15 s
// the two shards hold 1.5 + 2 = 3.5, r still 3; r reaches 4 only after 30 s.
func TestR6ShardedResetWhenTheOtherShardIsFull(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	cfg := ratelimit.Config{Rate: 8, Period: time.Minute, Capacity: 8, Shards: 4}
	m, err := httplimit.New(&httplimit.Config{Secret: secret, Policies: []httplimit.Policy{{Name: "sharded", Config: cfg}}})
	require.NoError(t, err)
	res, err := b.limiter.LimitN(context.Background(), b.pool, "sharded", "k", 1, &ratelimit.LimitOpts{Config: &cfg})
	require.NoError(t, err)
	require.True(t, res.OK)
	require.Equal(t, 3.0, res.Value, "two fresh shards looked at, one charged: 1 + 2")
	require.Len(t, res.Shards, 1)
	w := httptest.NewRecorder()
	m.WriteHeaders(w, res)
	lim, err := httpsfv.UnmarshalList(w.Header().Values("RateLimit"))
	require.NoError(t, err)
	rv, _ := lim[0].(httpsfv.Item).Params.Get("r")
	tv, _ := lim[0].(httpsfv.Item).Params.Get("t")
	r, tt := rv.(int64), tv.(int64)

	// t seconds later: the charged shard has refilled at Rate/N; every other shard (the one looked
	// at among them) is still full, at Capacity/N, and gained nothing.
	later, err := ratelimit.New(&ratelimit.LimiterConfig{Now: func() time.Time { return t0.Add(time.Duration(tt) * time.Second) }})
	require.NoError(t, err)
	st, err := later.State(context.Background(), b.pool, "sharded", "k", &ratelimit.LimitOpts{Config: &cfg})
	require.NoError(t, err)
	charged := st.Shards[res.Shards[0]]
	other := 0.0
	for i, v := range st.Shards {
		if i != res.Shards[0] {
			other = math.Max(other, v)
		}
	}
	require.GreaterOrEqual(t, int64(math.Floor(charged+other)), r+1,
		"RateLimit %q: t=%d s after the grant the two shards looked at hold %g + %g: r is still %d, not %d (shards now %v)",
		w.Header().Get("RateLimit"), tt, charged, other, int64(math.Floor(charged+other)), r+1, st.Shards)
}

// Review r6. Draft -10 §3.1.2 (Quota Unit Parameter): the "qu" value "MUST be a String. Allowed
// values are listed in the RateLimit Quota Units registry" (requests, content-bytes,
// concurrent-requests); and §5: "Malformed RateLimit header fields MUST be ignored". New checks
// only that Policy.QuotaUnit is printable ASCII, so qu="tokens" or qu="bytes" goes out on every
// response, and a client that holds to the registry may drop the whole RateLimit-Policy field
// (every policy's q and w with it). Policy.QuotaUnit's own doc lists the registered values.
func TestR6QuotaUnitOutsideTheRegistryIsRefused(t *testing.T) {
	t.Parallel()
	for _, unit := range []string{"tokens", "bytes", "Requests", "content bytes"} {
		_, err := httplimit.New(&httplimit.Config{Secret: secret,
			Policies: []httplimit.Policy{{Name: "a", Config: perIP, QuotaUnit: unit}}})
		require.Error(t, err, "QuotaUnit %q is not in the draft's RateLimit Quota Units registry, yet New accepts it", unit)
	}
	for _, unit := range []string{"", "requests", "content-bytes", "concurrent-requests"} {
		_, err := httplimit.New(&httplimit.Config{Secret: secret,
			Policies: []httplimit.Policy{{Name: "a", Config: perIP, QuotaUnit: unit}}})
		require.NoError(t, err, "QuotaUnit %q", unit)
	}
}

// Review r6. A request's context can end for a reason other than its client leaving: a server
// that cancels its BaseContext to shut down ends every request in flight, with a cause of its
// own. net/http cancels a request whose client went away (connection closed, HTTP/2 stream reset)
// without a cause (context.Cause is context.Canceled), so the two can be told apart; yet such a
// request is answered 499, nginx's "client closed request", which canceledStatus justifies by
// "the client went away" and the package doc by "no client reads" it. Here the client is still
// connected and reads it: as for a passed deadline ("the client may still be waiting for an
// answer"), the answer is 503.
func TestR6ShutdownIsNotAClientClosedRequest(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(errServerShutdown)
	run := serveEnded(t, ctx, httplimit.Config{FailOpen: true,
		Policies: []httplimit.Policy{{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)}}})
	require.False(t, run.handlerRan)
	require.Equal(t, int64(1), run.requests("perIP", "canceled"))
	require.Equal(t, 503, run.status, "the server shut down (context.Cause %v) while the client waited; answered as if the client had closed the request", context.Cause(ctx))
}

var errServerShutdown = errors.New("server shutting down")
