package httplimit_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dunglas/httpsfv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/txlimit/txlimit/httplimit"
	"github.com/txlimit/txlimit/internal/metrictest"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

var (
	t0     = time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	secret = []byte("test secret")
	// perIP: 10 per minute, a burst of 3: a token every 6 s.
	perIP = ratelimit.Config{Rate: 10, Period: time.Minute, Capacity: 3}
)

type bundle struct {
	pool    *pgxpool.Pool
	limiter *ratelimit.Limiter
	reader  *sdkmetric.ManualReader // the middleware's metrics
	lreader *sdkmetric.ManualReader // the limiter's metrics
}

// setup gives a migrated schema and a Limiter whose clock is t0 (now nil: the database's clock).
func setup(t *testing.T, now func() time.Time) *bundle {
	t.Helper()
	b := &bundle{pool: testdb.Pool(t, nil), reader: sdkmetric.NewManualReader(), lreader: sdkmetric.NewManualReader()}
	var err error
	b.limiter, err = ratelimit.New(&ratelimit.LimiterConfig{
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(b.lreader)),
		Now:           now,
	})
	require.NoError(t, err)
	return b
}

func fixed() time.Time { return t0 }

// serve starts a real server with the middleware in front of a handler that answers "ok".
func (b *bundle) serve(t *testing.T, cfg httplimit.Config) string {
	t.Helper()
	if cfg.Decider == nil {
		cfg.Decider = httplimit.OnPool(b.limiter, b.pool)
	}
	if cfg.Secret == nil {
		cfg.Secret = secret
	}
	cfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(b.reader))
	m, err := httplimit.New(&cfg)
	require.NoError(t, err)
	srv := httptest.NewServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "ok")
	})))
	t.Cleanup(srv.Close)
	return srv.URL
}

type response struct {
	status int
	header http.Header
	body   string
}

func get(t *testing.T, url string, header ...string) response {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return response{resp.StatusCode, resp.Header, string(body)}
}

// pk is the documented partition key: HMAC-SHA256(secret, name 0x00 key), first 12 bytes.
func pk(name, key string) []byte {
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(name + "\x00" + key))
	return mac.Sum(nil)[:12]
}

func requests(t *testing.T, b *bundle, policy, outcome string) int64 {
	return metrictest.Counter(t, b.reader, "txlimit.http.requests", attribute.String("txlimit.policy", policy), attribute.String("txlimit.outcome", outcome))
}

// item checks one parsed Structured Field item: its name and exact parameters, in order.
func item(t *testing.T, step int, got httpsfv.Member, name string, params ...any) {
	t.Helper()
	it, ok := got.(httpsfv.Item)
	require.True(t, ok, "step %d: not an item: %#v", step, got)
	require.Equal(t, name, it.Value, "step %d", step)
	var gotParams []any
	for _, k := range it.Params.Names() {
		v, _ := it.Params.Get(k)
		gotParams = append(gotParams, k, v)
	}
	require.Equal(t, params, gotParams, "step %d: %s", step, name)
}

func TestHeadersAndDenial(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	url := b.serve(t, httplimit.Config{Policies: []httplimit.Policy{{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)}}})
	key := "127.0.0.1"

	// Decided at t0 each time: 3, 2, 1 tokens left... then none.
	for i, want := range []struct {
		status int
		r, t   int64
	}{{200, 2, 6}, {200, 1, 6}, {200, 0, 6}, {429, 0, 6}} {
		res := get(t, url)
		require.Equal(t, want.status, res.status, "step %d", i)
		pol, err := httpsfv.UnmarshalList(res.header.Values("RateLimit-Policy"))
		require.NoError(t, err, "step %d", i)
		require.Len(t, pol, 1)
		item(t, i, pol[0], "perIP", "q", int64(10), "w", int64(60), "txlimit-burst", int64(3), "pk", pk("perIP", key))
		lim, err := httpsfv.UnmarshalList(res.header.Values("RateLimit"))
		require.NoError(t, err, "step %d", i)
		require.Len(t, lim, 1)
		item(t, i, lim[0], "perIP", "r", want.r, "t", want.t, "pk", pk("perIP", key))
		if want.status == 200 {
			require.Equal(t, "ok", res.body)
			require.Empty(t, res.header.Get("Retry-After"))
			continue
		}
		// 0 tokens at t0, one wanted, 10 per minute: 6 s.
		require.Equal(t, "6", res.header.Get("Retry-After"))
		require.Equal(t, "application/problem+json", res.header.Get("Content-Type"))
		require.JSONEq(t, `{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded",
			"title":"Request cannot be satisfied as assigned quota has been exceeded","status":429,
			"violated-policies":["perIP"]}`, res.body)
	}
	// The key never appears; the pk is the documented HMAC.
	res := get(t, url)
	require.NotContains(t, fmt.Sprint(res.header), key)
	require.Equal(t, `"perIP";r=0;t=6;pk=:`+b64(pk("perIP", key))+`:`, res.header.Get("RateLimit"))

	require.Equal(t, int64(3), requests(t, b, "perIP", "granted"))
	require.Equal(t, int64(2), requests(t, b, "perIP", "denied"))
	lim := func(outcome string) int64 {
		return metrictest.Counter(t, b.lreader, "txlimit.decisions", attribute.String("txlimit.op", "LimitN"), // one policy: OnPool uses LimitN
			attribute.String("txlimit.limit", "perIP"), attribute.String("txlimit.outcome", outcome))
	}
	require.Equal(t, int64(3), lim("granted"))
	require.Equal(t, int64(2), lim("denied"))
}

// A fixed window grants at most Capacity tokens per window (docs/spec.md §4: v = min(value +
// Rate·n, cap) − count; "a fixed window grants at most cap tokens within one window"). With
// Capacity below Rate, RateLimit-Policy must not advertise q = Rate per window (10 requests per
// 60 s, of which only 5 are ever granted): the draft's q is "the quota allocated ... for a given
// quota partition" over w, and quota() promises "never more quota ... than the limit grants".
func TestFixedWindowQuotaIsWhatAWindowGrants(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	cfg := ratelimit.Config{Kind: ratelimit.FixedWindow, Rate: 10, Period: time.Minute, Capacity: 5}
	url := b.serve(t, httplimit.Config{Policies: []httplimit.Policy{{Name: "fw", Config: cfg, Key: httplimit.ClientIP(nil)}}})
	granted := int64(0)
	var q int64
	for i := range 7 { // all at t0: one window
		res := get(t, url)
		if res.status == http.StatusOK {
			granted++
		}
		pol, err := httpsfv.UnmarshalList(res.header.Values("RateLimit-Policy"))
		require.NoError(t, err, "step %d", i)
		v, _ := pol[0].(httpsfv.Item).Params.Get("q")
		q = v.(int64)
	}
	require.Equal(t, int64(5), granted, "the window grants Capacity requests")
	require.LessOrEqual(t, q, granted, "RateLimit-Policy advertises q=%d per window; the window granted %d", q, granted)
}

// Config.Cost makes a request take several tokens, "e.g. from its size". The draft's q and r are
// in quota units, and without a "qu" parameter the unit is "requests" (draft -10 §3.1: "The
// default quota unit is "requests""; §3.1.2 defines "content-bytes" for sizes). Without it, a
// client told q=1000 requests and, after one request, r=900 requests left, would get its 429 on
// the eleventh: Policy.QuotaUnit says what the tokens are, as qu.
func TestCostInTokensIsNotAdvertisedAsRequests(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	url := b.serve(t, httplimit.Config{
		Cost: func(r *http.Request) (float64, error) { return 100, nil }, // e.g. the bytes it uploads
		Policies: []httplimit.Policy{{Name: "bytes", Config: ratelimit.Config{Rate: 1000, Period: time.Minute}, Key: httplimit.ClientIP(nil),
			QuotaUnit: "content-bytes"}},
	})
	res := get(t, url)
	require.Equal(t, http.StatusOK, res.status)
	pol, err := httpsfv.UnmarshalList(res.header.Values("RateLimit-Policy"))
	require.NoError(t, err)
	item(t, 0, pol[0], "bytes", "q", int64(1000), "qu", "content-bytes", "w", int64(60), "pk", pk("bytes", "127.0.0.1"))
	require.Equal(t, `"bytes";q=1000;qu="content-bytes";w=60;pk=:`+b64(pk("bytes", "127.0.0.1"))+`:`, res.header.Get("RateLimit-Policy"))
	lim, err := httpsfv.UnmarshalList(res.header.Values("RateLimit"))
	require.NoError(t, err)
	item(t, 0, lim[0], "bytes", "r", int64(900), "t", int64(1), "pk", pk("bytes", "127.0.0.1")) // a token every 60 ms
}

// For a granted token bucket the package doc defines t as the seconds "until r grows by one", and
// r as ratelimit.Result.Value, which for a sharded limit covers only the one or two shards the
// call looked at (docs/spec.md §8), each refilling at Rate/Shards. Computed with the whole Rate,
// t would tell clients on a policy with Shards: 4 to come back at least twice too soon (N/k
// times: 4× when one shard was looked at). Which of the shards looked at refill (a full one does
// not) the Result does not say, so t is computed at the rate of one: never too soon.
func TestShardedResetUsesTheShardsRate(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	cfg := ratelimit.Config{Rate: 8, Period: time.Minute, Capacity: 8, Shards: 4} // each shard: 2 per minute
	m, err := httplimit.New(&httplimit.Config{Secret: secret, Policies: []httplimit.Policy{{Name: "sharded", Config: cfg}}})
	require.NoError(t, err)
	res, err := b.limiter.LimitN(context.Background(), b.pool, "sharded", "k", 1, &ratelimit.LimitOpts{Config: &cfg})
	require.NoError(t, err)
	require.True(t, res.OK)
	r, tt := limitRT(t, m, res)
	// r grows by one when the shards looked at (at most two) have gained next − Value tokens, at
	// 2·Rate/Shards per Period at the fastest.
	need := float64(r+1) - res.Value
	fastest := 2 * cfg.Rate / float64(cfg.Shards) / cfg.Period.Seconds() // tokens per second
	minT := int64(math.Ceil(need / fastest))
	require.GreaterOrEqual(t, tt, minT, "Value %v over the shards looked at (charged %v): r=%d, t=%d, but r cannot grow by one before %d s",
		res.Value, res.Shards, r, tt, minT)
	// On the pool (READ COMMITTED) the call looked at two fresh shards and charged one: 1 + 2 left,
	// the other one full; one more token at the charged shard's 2 per minute takes 30 s.
	require.Equal(t, 3.0, res.Value)
	require.Equal(t, int64(30), tt)

	// Two shards hold at most 2·Capacity/Shards: at that, r cannot grow, and there is no t.
	w := httptest.NewRecorder()
	m.WriteHeaders(w, ratelimit.Result{Name: "sharded", Key: "k", OK: true, Value: 4})
	require.Equal(t, `"sharded";r=4;pk=:`+b64(pk("sharded", "k"))+`:`, w.Header().Get("RateLimit"))
}

// limitRT returns the r and t parameters of the RateLimit field m writes for res (t: 0 when absent).
func limitRT(t *testing.T, m *httplimit.Middleware, res ratelimit.Result) (r, tt int64) {
	t.Helper()
	w := httptest.NewRecorder()
	m.WriteHeaders(w, res)
	lim, err := httpsfv.UnmarshalList(w.Header().Values("RateLimit"))
	require.NoError(t, err)
	require.Len(t, lim, 1)
	params := lim[0].(httpsfv.Item).Params
	rv, ok := params.Get("r")
	require.True(t, ok, "no r")
	if tv, ok := params.Get("t"); ok {
		tt = tv.(int64)
	}
	return rv.(int64), tt
}

func b64(b []byte) string {
	s, err := httpsfv.Marshal(httpsfv.NewItem(b))
	if err != nil {
		panic(err)
	}
	return strings.Trim(s, ":")
}

// Two policies are decided together: the user's denial consumes nothing of the IP's quota.
func TestPerIPAndPerUser(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	url := b.serve(t, httplimit.Config{Policies: []httplimit.Policy{
		{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)},
		{Name: "perUser", Config: ratelimit.Config{Rate: 1, Period: time.Hour}, Key: httplimit.Header("X-User")},
	}})
	require.Equal(t, 200, get(t, url, "X-User", "alice").status)
	res := get(t, url, "X-User", "alice")
	require.Equal(t, 429, res.status)
	require.JSONEq(t, `{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded",
		"title":"Request cannot be satisfied as assigned quota has been exceeded","status":429,
		"violated-policies":["perUser"]}`, res.body)
	// One token per hour: 3600 s. perIP alone would have been granted: it shows what it would
	// have left (1), though nothing was consumed.
	require.Equal(t, "3600", res.header.Get("Retry-After"))
	lim, err := httpsfv.UnmarshalList(res.header.Values("RateLimit"))
	require.NoError(t, err)
	item(t, 0, lim[0], "perIP", "r", int64(1), "t", int64(6), "pk", pk("perIP", "127.0.0.1"))
	item(t, 1, lim[1], "perUser", "r", int64(0), "t", int64(3600), "pk", pk("perUser", "alice"))
	// perIP had 2 left before the denial and still has: bob's request takes it to 1.
	res = get(t, url, "X-User", "bob")
	require.Equal(t, 200, res.status)
	lim, err = httpsfv.UnmarshalList(res.header.Values("RateLimit"))
	require.NoError(t, err)
	item(t, 2, lim[0], "perIP", "r", int64(1), "t", int64(6), "pk", pk("perIP", "127.0.0.1"))
	// No user: 400 by default.
	res = get(t, url)
	require.Equal(t, 400, res.status)
	require.Equal(t, "application/problem+json", res.header.Get("Content-Type"))
	require.Equal(t, int64(1), requests(t, b, "perUser", "no_key"))
}

func TestRetryAfterJitter(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	url := b.serve(t, httplimit.Config{
		Policies: []httplimit.Policy{{Name: "perIP", Config: ratelimit.Config{Rate: 10, Period: time.Minute, Capacity: 1},
			Key: httplimit.ClientIP(&httplimit.IPOpts{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}})}},
		RetryJitter: 10 * time.Second,
	})
	jitter := func(key string) int64 {
		mac := hmac.New(sha256.New, secret)
		mac.Write([]byte("retry-after\x00" + key))
		return int64(binary.BigEndian.Uint64(mac.Sum(nil)[:8]) % 11)
	}
	seen := map[int64]bool{}
	for i, ip := range []string{"203.0.113.1", "203.0.113.2", "203.0.113.3", "203.0.113.4"} {
		require.Equal(t, 200, get(t, url, "X-Forwarded-For", ip).status)
		for range 2 { // the same every time for one identity
			res := get(t, url, "X-Forwarded-For", ip)
			require.Equal(t, 429, res.status)
			want := 6 + jitter(ip)
			require.Equal(t, fmt.Sprint(want), res.header.Get("Retry-After"), "step %d", i)
			lim, err := httpsfv.UnmarshalList(res.header.Values("RateLimit"))
			require.NoError(t, err)
			item(t, i, lim[0], "perIP", "r", int64(0), "t", int64(6), "pk", pk("perIP", ip)) // t is the wait without jitter
		}
		seen[jitter(ip)] = true
	}
	require.Greater(t, len(seen), 1, "four identities all got the same jitter")
}

func TestForwardedFor(t *testing.T) {
	t.Parallel()
	one := ratelimit.Config{Rate: 1, Period: time.Hour}
	t.Run("untrusted peer: spoofed headers ignored", func(t *testing.T) {
		t.Parallel()
		b := setup(t, fixed)
		url := b.serve(t, httplimit.Config{Policies: []httplimit.Policy{{Name: "perIP", Config: one, Key: httplimit.ClientIP(nil)}}})
		require.Equal(t, 200, get(t, url, "X-Forwarded-For", "203.0.113.1").status)
		require.Equal(t, 429, get(t, url, "X-Forwarded-For", "203.0.113.2").status)
		require.Equal(t, 429, get(t, url, "Forwarded", "for=203.0.113.3").status)
		res := get(t, url, "X-Real-IP", "203.0.113.4")
		require.Equal(t, 429, res.status)
		lim, err := httpsfv.UnmarshalList(res.header.Values("RateLimit"))
		require.NoError(t, err)
		item(t, 0, lim[0], "perIP", "r", int64(0), "t", int64(3600), "pk", pk("perIP", "127.0.0.1"))
	})
	t.Run("trusted peer: right-most untrusted address of the one header", func(t *testing.T) {
		t.Parallel()
		b := setup(t, fixed)
		trusted := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("10.0.0.0/8")}
		url := b.serve(t, httplimit.Config{Policies: []httplimit.Policy{{Name: "perIP", Config: one,
			Key: httplimit.ClientIP(&httplimit.IPOpts{TrustedProxies: trusted})}}})
		for i, c := range []struct {
			header, value string
			status        int
			key           string
		}{
			{"X-Forwarded-For", "203.0.113.1", 200, "203.0.113.1"},
			{"X-Forwarded-For", "203.0.113.2", 200, "203.0.113.2"},
			{"X-Forwarded-For", "203.0.113.1", 429, "203.0.113.1"},
			// A client's own spoofed entry sits left of what our proxies appended.
			{"X-Forwarded-For", "198.51.100.9, 203.0.113.1, 10.1.2.3", 429, "203.0.113.1"},
			// The proxies write X-Forwarded-For (the default IPOpts.Header): other forwarding
			// headers are ignored, and a trusted peer without it is keyed by its own address.
			{"Forwarded", `for=198.51.100.7;proto=https, for="10.0.0.1"`, 200, "127.0.0.1"},
			{"X-Real-IP", "198.51.100.8", 429, "127.0.0.1"},
		} {
			res := get(t, url, c.header, c.value)
			require.Equal(t, c.status, res.status, "step %d", i)
			lim, err := httpsfv.UnmarshalList(res.header.Values("RateLimit"))
			require.NoError(t, err)
			got, _ := lim[0].(httpsfv.Item).Params.Get("pk")
			require.Equal(t, pk("perIP", c.key), got, "step %d", i)
		}
	})
}

func TestIPv6Grouping(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	url := b.serve(t, httplimit.Config{Policies: []httplimit.Policy{{Name: "perIP", Config: ratelimit.Config{Rate: 1, Period: time.Hour},
		Key: httplimit.ClientIP(&httplimit.IPOpts{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}})}}})
	for i, c := range []struct {
		header, value string
		status        int
	}{
		{"X-Forwarded-For", "2001:db8:1:2::1", 200},
		{"X-Forwarded-For", "2001:db8:1:2:ffff:ffff:ffff:9", 429}, // same /64
		{"X-Forwarded-For", "[2001:db8:1:2::77]:4711", 429},       // same /64
		{"X-Forwarded-For", "2001:db8:1:3::1", 200},               // next /64
		{"X-Forwarded-For", "::ffff:192.0.2.1", 200},              // IPv4-mapped: IPv4
		{"X-Forwarded-For", "192.0.2.1", 429},
	} {
		require.Equal(t, c.status, get(t, url, c.header, c.value).status, "step %d", i)
	}
	key := httplimit.ClientIP(&httplimit.IPOpts{IPv6Prefix: 48})
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = "[2001:db8:1:2::1%eth0]:1234"
	k, err := key(r)
	require.NoError(t, err)
	require.Equal(t, "2001:db8:1::/48", k)
}

// deadPool is a pool on a port where nothing listens.
func deadPool(t *testing.T) *pgxpool.Pool {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close()) // nothing listens there now
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@"+addr+"/test?sslmode=disable&connect_timeout=5")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// A database that does not answer: 503 by default, let through and counted with FailOpen.
func TestDatabaseDown(t *testing.T) {
	t.Parallel()
	pool := deadPool(t)
	b := setup(t, fixed)
	policies := []httplimit.Policy{{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)}}

	url := b.serve(t, httplimit.Config{Policies: policies, Decider: httplimit.OnPool(b.limiter, pool)})
	res := get(t, url)
	require.Equal(t, 503, res.status)
	require.JSONEq(t, `{"type":"about:blank","title":"Service Unavailable","status":503,"detail":"the rate limit could not be decided"}`, res.body)
	require.Equal(t, "5", res.header.Get("Retry-After")) // DefaultFailClosedRetryAfter
	require.Empty(t, res.header.Get("RateLimit"))
	require.Equal(t, int64(1), requests(t, b, "perIP", "error"))

	var logs metrictest.Logs
	b2 := setup(t, fixed)
	url = b2.serve(t, httplimit.Config{Policies: policies, Decider: httplimit.OnPool(b2.limiter, pool), FailOpen: true,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	for range 2 {
		res = get(t, url)
		require.Equal(t, 200, res.status)
		require.Equal(t, "ok", res.body)
	}
	require.Equal(t, int64(2), requests(t, b2, "perIP", "fail_open"))
	require.Equal(t, 2, strings.Count(logs.String(), "request let through (FailOpen)"), logs.String())
}

func TestShadow(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	url := b.serve(t, httplimit.Config{Shadow: true,
		Policies: []httplimit.Policy{{Name: "perIP", Config: ratelimit.Config{Rate: 1, Period: time.Hour}, Key: httplimit.ClientIP(nil)}}})
	for i := range 5 {
		res := get(t, url)
		require.Equal(t, 200, res.status, "step %d", i)
		require.Empty(t, res.header.Get("RateLimit"), "step %d", i)
		require.Empty(t, res.header.Get("Retry-After"), "step %d", i)
	}
	require.Equal(t, int64(1), requests(t, b, "perIP", "granted"))
	require.Equal(t, int64(4), requests(t, b, "perIP", "shadow_denied"))

	// Nor on a missing key or a database that does not answer.
	b2 := setup(t, fixed) // a reader of its own
	url = b2.serve(t, httplimit.Config{Shadow: true, Decider: httplimit.OnPool(b2.limiter, deadPool(t)),
		Policies: []httplimit.Policy{{Name: "perUser", Config: perIP, Key: httplimit.Header("X-User")}}})
	require.Equal(t, 200, get(t, url).status)
	require.Equal(t, 200, get(t, url, "X-User", "u").status)
	require.Equal(t, int64(1), requests(t, b2, "perUser", "no_key"))
	require.Equal(t, int64(1), requests(t, b2, "perUser", "fail_open"))
}

func TestClientIPWithoutAnIP(t *testing.T) {
	t.Parallel()
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = "@"
	_, err := httplimit.ClientIP(nil)(r)
	require.ErrorIs(t, err, httplimit.ErrNoKey)
}

func TestInvalidInput(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	url := b.serve(t, httplimit.Config{
		Policies: []httplimit.Policy{
			{Name: "perKey", Config: perIP, Key: httplimit.Header("X-API-Key")},
			{Name: "perUser", Config: perIP, Key: httplimit.Header("X-User"), MissingKey: httplimit.MissingKeySkip},
		},
		Cost: func(r *http.Request) (float64, error) {
			if r.URL.Query().Get("cost") == "" {
				return 1, nil
			}
			var c float64
			_, err := fmt.Sscan(r.URL.Query().Get("cost"), &c)
			return c, err
		},
	})
	res := get(t, url, "X-API-Key", strings.Repeat("k", ratelimit.MaxKeyLen+1))
	require.Equal(t, 400, res.status) // ratelimit.ErrInvalid
	require.Equal(t, int64(1), requests(t, b, "perKey", "invalid"))
	require.Equal(t, 400, get(t, url+"?cost=-1", "X-API-Key", "k").status)
	require.Equal(t, 400, get(t, url+"?cost=4", "X-API-Key", "k").status) // more than the burst: never grantable
	// A cost of 3 takes the whole burst; the skipped user policy is not reported.
	res = get(t, url+"?cost=3", "X-API-Key", "k")
	require.Equal(t, 200, res.status)
	require.Equal(t, `"perKey";r=0;t=6;pk=:`+b64(pk("perKey", "k"))+`:`, res.header.Get("RateLimit"))
	require.Equal(t, int64(3), requests(t, b, "perUser", "skipped"))      // the requests that got to the keys
	require.Equal(t, 200, get(t, url+"?cost=0", "X-API-Key", "k").status) // not limited
}

// 64 clients at once, two requests each, against a burst of 10 refilling once an hour: exactly 10
// are granted (decided on the database's clock; the refill in the test's few seconds is < 0.01).
func TestConcurrentClients(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	url := b.serve(t, httplimit.Config{Policies: []httplimit.Policy{{Name: "global", Config: ratelimit.Config{Rate: 1, Period: time.Hour, Capacity: 10},
		Key: func(*http.Request) (string, error) { return "all", nil }}}})
	var mu sync.Mutex
	counts := map[int]int{}
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			client := &http.Client{Transport: &http.Transport{}}
			defer client.CloseIdleConnections()
			for range 2 {
				resp, err := client.Get(url)
				if err != nil {
					t.Error(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				mu.Lock()
				counts[resp.StatusCode]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.Equal(t, map[int]int{200: 10, 429: 118}, counts)
}

// A handler that limits inside its own transaction reports with WriteHeaders / WriteDenied.
func TestWriteHeadersFromHandler(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	send := ratelimit.Config{Rate: 2, Period: time.Minute}
	m, err := httplimit.New(&httplimit.Config{Secret: secret, Policies: []httplimit.Policy{{Name: "sendMessage", Config: send}}})
	require.NoError(t, err)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user := r.Header.Get("X-User")
		var res ratelimit.Result
		err := pgx.BeginFunc(r.Context(), b.pool, func(tx pgx.Tx) error {
			var err error
			if res, err = b.limiter.Limit(r.Context(), tx, "sendMessage", user, &ratelimit.LimitOpts{Config: &send}); err != nil {
				return err
			}
			return res.Err() // roll back on a denial
		})
		switch {
		case ratelimit.IsLimited(err):
			m.WriteDenied(w, res)
		case err != nil:
			http.Error(w, err.Error(), 500)
		default:
			m.WriteHeaders(w, res)
			w.WriteHeader(http.StatusCreated)
		}
	}))
	t.Cleanup(srv.Close)
	for i, want := range []struct {
		status int
		r, t   int64
		retry  string
	}{{201, 1, 30, ""}, {201, 0, 30, ""}, {429, 0, 30, "30"}} {
		res := get(t, srv.URL, "X-User", "u1")
		require.Equal(t, want.status, res.status, "step %d", i)
		require.Equal(t, want.retry, res.header.Get("Retry-After"), "step %d", i)
		pol, err := httpsfv.UnmarshalList(res.header.Values("RateLimit-Policy"))
		require.NoError(t, err)
		item(t, i, pol[0], "sendMessage", "q", int64(2), "w", int64(60), "pk", pk("sendMessage", "u1"))
		lim, err := httpsfv.UnmarshalList(res.header.Values("RateLimit"))
		require.NoError(t, err)
		item(t, i, lim[0], "sendMessage", "r", want.r, "t", want.t, "pk", pk("sendMessage", "u1"))
	}
}

// Behind the middleware, a handler's own items follow the middleware's in the same fields.
func TestWriteHeadersBehindMiddleware(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	send := ratelimit.Config{Rate: 2, Period: time.Minute}
	m, err := httplimit.New(&httplimit.Config{Secret: secret, Decider: httplimit.OnPool(b.limiter, b.pool), Policies: []httplimit.Policy{
		{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)},
		{Name: "sendMessage", Config: send},
	}})
	require.NoError(t, err)
	srv := httptest.NewServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		res, err := b.limiter.Limit(r.Context(), b.pool, "sendMessage", "u1", &ratelimit.LimitOpts{Config: &send})
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		m.WriteHeaders(w, res)
	})))
	t.Cleanup(srv.Close)
	res := get(t, srv.URL)
	require.Equal(t, 200, res.status)
	lim, err := httpsfv.UnmarshalList(res.header.Values("RateLimit"))
	require.NoError(t, err)
	require.Len(t, lim, 2)
	item(t, 0, lim[0], "perIP", "r", int64(2), "t", int64(6), "pk", pk("perIP", "127.0.0.1"))
	item(t, 1, lim[1], "sendMessage", "r", int64(1), "t", int64(30), "pk", pk("sendMessage", "u1"))
	pol, err := httpsfv.UnmarshalList(res.header.Values("RateLimit-Policy"))
	require.NoError(t, err)
	require.Len(t, pol, 2)
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	for i, cfg := range []*httplimit.Config{
		nil,
		{Policies: []httplimit.Policy{{Name: "", Config: perIP}}},
		{Policies: []httplimit.Policy{{Name: "a", Config: perIP}, {Name: "a", Config: perIP}}},
		{Policies: []httplimit.Policy{{Name: "a", Config: ratelimit.Config{Rate: 1}}}},
		{Policies: []httplimit.Policy{{Name: "a", Config: perIP, Key: httplimit.ClientIP(nil)}}}, // no Decider
		{Policies: []httplimit.Policy{{Name: "a", Config: perIP}}, RetryJitter: -time.Second},
	} {
		_, err := httplimit.New(cfg)
		require.Error(t, err, "case %d", i)
	}
	_, err := httplimit.New(&httplimit.Config{Policies: []httplimit.Policy{{Name: "a", Config: perIP}}, FailClosedRetryAfter: -time.Second})
	require.EqualError(t, err, "httplimit: New: set Config.FailClosedRetryAfter to 0 (the default, 5s) or more (got -1s)")
	_, err = httplimit.New(&httplimit.Config{Policies: []httplimit.Policy{{Name: "a", Config: perIP}}, DecisionTimeout: -time.Second})
	require.EqualError(t, err, "httplimit: New: set Config.DecisionTimeout to 0 (the default: no bound but the request's context) or more (got -1s)")

	// A name the header fields cannot carry (RFC 9651 Strings are printable ASCII) is refused
	// here, not found out later by responses that silently lose their RateLimit fields.
	for _, name := range []string{"café", "a\tb", "line\nbreak"} {
		_, err = httplimit.New(&httplimit.Config{Policies: []httplimit.Policy{{Name: "ok", Config: perIP}, {Name: name, Config: perIP}}})
		require.EqualError(t, err, fmt.Sprintf("httplimit: Config.Policies[1].Name %q cannot be written in the RateLimit header "+
			"fields: a Structured Field String is printable ASCII (0x20 to 0x7E)", name))
	}
	_, err = httplimit.New(&httplimit.Config{Policies: []httplimit.Policy{{Name: "per ip ~!", Config: perIP}}})
	require.NoError(t, err, "printable ASCII, spaces included, is a String")
	_, err = httplimit.New(&httplimit.Config{Policies: []httplimit.Policy{{Name: "a", Config: perIP, QuotaUnit: "octets\n"}}})
	require.EqualError(t, err, `httplimit: Config.Policies[0].QuotaUnit "octets\n" is not a quota unit of the draft's registry: `+
		`use "requests", "content-bytes" or "concurrent-requests", or leave it empty`)

	// A Decider that could decide nothing is refused here, not found out by every request (a nil
	// pool is invalid input to the Limiter: each request a 400).
	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{})
	require.NoError(t, err)
	pool := &pgxpool.Pool{} // never used: not connected
	var nilBatcher *ratelimit.Batcher
	for _, c := range []struct {
		decider httplimit.Decider
		err     string
	}{
		{httplimit.OnPool(limiter, nil), "httplimit: Config.Decider is OnPool(limiter, pool) with a nil limiter or pool: pass the *ratelimit.Limiter and the *pgxpool.Pool to decide on"},
		{httplimit.OnPool(nil, pool), "httplimit: Config.Decider is OnPool(limiter, pool) with a nil limiter or pool: pass the *ratelimit.Limiter and the *pgxpool.Pool to decide on"},
		{nilBatcher, "httplimit: Config.Decider is a nil *ratelimit.Batcher: pass the one ratelimit.NewBatcher(pool, limiter, nil) returns"},
	} {
		_, err = httplimit.New(&httplimit.Config{Decider: c.decider, Policies: []httplimit.Policy{{Name: "a", Config: perIP, Key: httplimit.ClientIP(nil)}}})
		require.EqualError(t, err, c.err)
	}
}

// A policy with Rate below 1 and the default Capacity (= Rate) can never grant the default cost of
// 1 (docs/spec.md §5: a count above cap is an argument error). Accepted, every request would be
// answered 400 Bad Request ("the request's rate limit input is invalid"), blaming each client for
// the server's configuration; New refuses it, naming the field, as it refuses names the fields
// cannot carry. The bound is ratelimit's: with Shards N, two shards of Capacity/N together.
func TestPolicyThatCanNeverGrantOneRequest(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	decided := func(c ratelimit.Config) *httplimit.Config {
		return &httplimit.Config{Decider: httplimit.OnPool(b.limiter, b.pool), Secret: secret,
			Policies: []httplimit.Policy{{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)},
				{Name: "slow", Config: c, Key: httplimit.ClientIP(nil)}}}
	}
	// One request every two hours, as the package doc's q=1;w=7200 reading suggests.
	_, err := httplimit.New(decided(ratelimit.Config{Rate: 0.5, Period: time.Hour}))
	var cerr *ratelimit.ConfigError
	require.ErrorAs(t, err, &cerr)
	require.ErrorIs(t, err, ratelimit.ErrInvalid)
	require.Equal(t, "slow", cerr.Limit)
	require.Equal(t, "Capacity", cerr.Field)
	require.Equal(t, 0.5, cerr.Value)
	require.EqualError(t, err, `ratelimit: limit "slow": Config.Capacity must be at least 1, the cost of a request when `+
		`Config.Cost is nil (Capacity defaults to Rate) (got 0.5)`)
	// With a Capacity of 1 it grants one request every two hours.
	m, err := httplimit.New(decided(ratelimit.Config{Rate: 0.5, Period: time.Hour, Capacity: 1}))
	require.NoError(t, err)
	w := httptest.NewRecorder()
	m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {})).ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/", nil))
	require.Equal(t, http.StatusOK, w.Code, "%s", w.Body)

	// Sharded: two shards of Capacity/Shards must hold 1 together.
	_, err = httplimit.New(decided(ratelimit.Config{Rate: 10, Period: time.Minute, Capacity: 1.5, Shards: 4}))
	require.ErrorAs(t, err, &cerr)
	require.Equal(t, "Capacity", cerr.Field)
	require.Contains(t, err.Error(), "must be at least Shards/2 (2)")
	_, err = httplimit.New(decided(ratelimit.Config{Rate: 10, Period: time.Minute, Capacity: 2, Shards: 4}))
	require.NoError(t, err)

	// With a Cost the cost is the request's, and a policy without a Key is decided by the handler,
	// with counts of its own: both are left to the decision.
	cfg := decided(ratelimit.Config{Rate: 0.5, Period: time.Hour})
	cfg.Cost = func(*http.Request) (float64, error) { return 0.5, nil }
	_, err = httplimit.New(cfg)
	require.NoError(t, err)
	_, err = httplimit.New(&httplimit.Config{Secret: secret,
		Policies: []httplimit.Policy{{Name: "slow", Config: ratelimit.Config{Rate: 0.5, Period: time.Hour}}}})
	require.NoError(t, err)
}

// The package doc defines t, for a granted token bucket, as the seconds "until r grows by one";
// for Shards N >= 2, r covers the two shards the call looked at. A full shard does not refill: on
// a fresh key (the first request of every client) the call looks at two full shards and charges
// one, so only that one refills, at Rate/N. Rate 8/min over 4 shards (each 2/min, capacity 2):
// r=3 (1 + 2); after 15 s the two shards hold 1.5 + 2 = 3.5, r still 3; r reaches 4 after 30 s,
// and t must not say less.
func TestShardedResetWhenTheOtherShardIsFull(t *testing.T) {
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
	r, tt := limitRT(t, m, res)

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
		"RateLimit r=%d;t=%d: t s after the grant the two shards looked at hold %g + %g: r is still %d, not %d (shards now %v)",
		r, tt, charged, other, int64(math.Floor(charged+other)), r+1, st.Shards)
}

// Review r6. Draft -10 §3.1.2 (Quota Unit Parameter): the "qu" value "MUST be a String. Allowed
// values are listed in the RateLimit Quota Units registry" (requests, content-bytes,
// concurrent-requests); and §5: "Malformed RateLimit header fields MUST be ignored". New checks
// only that Policy.QuotaUnit is printable ASCII, so qu="tokens" or qu="bytes" goes out on every
// response, and a client that holds to the registry may drop the whole RateLimit-Policy field
// (every policy's q and w with it). Policy.QuotaUnit's own doc lists the registered values.
func TestQuotaUnitOutsideTheRegistryIsRefused(t *testing.T) {
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
func TestShutdownIsNotAClientClosedRequest(t *testing.T) {
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

// Review rv-http2. Retry-After is "the longest wait of the denied policies in whole seconds,
// rounded up", and t "the seconds until the request would be granted": both must never tell a
// client to come back sooner than the limit grants. A RetryAt is at most Time plus 2^61 µs (about
// 73,000 years), more than a time.Duration holds, so Result.RetryAfter saturates at about 292
// years; seconds taken from it would promise a retry centuries too soon. A limit of one request
// per 1,000 years (Rate 0.1 per 100 years, a valid Config) gives such a wait.
func TestRetryAfterBeyondADurationIsNotShortened(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	period := 100 * 365 * 24 * time.Hour
	url := b.serve(t, httplimit.Config{Policies: []httplimit.Policy{{Name: "millennial",
		Config: ratelimit.Config{Rate: 0.1, Period: period, Capacity: 1}, Key: httplimit.ClientIP(nil)}}})
	require.Equal(t, http.StatusOK, get(t, url).status)
	res := get(t, url)
	require.Equal(t, http.StatusTooManyRequests, res.status)
	// One token at 0.1 per 100 years: 1,000 years of 365 days, in whole seconds.
	wait := 10 * int64(period/time.Second)
	require.Equal(t, fmt.Sprint(wait), res.header.Get("Retry-After"))
	lim, err := httpsfv.UnmarshalList(res.header.Values("RateLimit"))
	require.NoError(t, err)
	item(t, 0, lim[0], "millennial", "r", int64(0), "t", wait, "pk", pk("millennial", "127.0.0.1"))
}

// Retry-After and t round the wait up to whole seconds (docs/spec.md §11: 2.3 s gives 3), wherever
// the decision's Time falls within its second.
func TestRetryAfterRoundsTheWaitUp(t *testing.T) {
	t.Parallel()
	m, err := httplimit.New(&httplimit.Config{Secret: secret, Policies: []httplimit.Policy{{Name: "perIP", Config: perIP}}})
	require.NoError(t, err)
	for _, c := range []struct {
		at   time.Duration // Time within its second
		wait time.Duration
		want string
	}{
		{0, 2300 * time.Millisecond, "3"},
		{800 * time.Millisecond, 2300 * time.Millisecond, "3"},
		{100 * time.Millisecond, 2300 * time.Millisecond, "3"},
		{700 * time.Millisecond, 2300 * time.Millisecond, "3"},
		{700 * time.Millisecond, 6 * time.Second, "6"},
		{700 * time.Millisecond, time.Microsecond, "1"},
	} {
		now := t0.Add(c.at)
		w := httptest.NewRecorder()
		m.WriteDenied(w, ratelimit.Result{Name: "perIP", Key: "k", Time: now, RetryAt: now.Add(c.wait)})
		require.Equal(t, c.want, w.Header().Get("Retry-After"), "wait %s from %s", c.wait, now)
		require.Equal(t, `"perIP";r=0;t=`+c.want+`;pk=:`+b64(pk("perIP", "k"))+`:`, w.Header().Get("RateLimit"))
	}
}

// Review rv-http2. For a granted token bucket the package doc defines t as the seconds "until r
// grows by one". With a cost below 1 and a Capacity that is not whole, r can stand at
// floor(Capacity) with the limit not yet full: Capacity 3.5 less a cost of 0.2 leaves 3.3, r=3,
// and the limit refills to 3.5, never to 4. A t there promises a whole unit that never comes.
func TestResetWhenRCannotGrow(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	cfg := ratelimit.Config{Rate: 10, Period: time.Minute, Capacity: 3.5}
	m, err := httplimit.New(&httplimit.Config{Secret: secret, Policies: []httplimit.Policy{{Name: "bytes", Config: cfg, QuotaUnit: "content-bytes"}}})
	require.NoError(t, err)
	res, err := b.limiter.LimitN(context.Background(), b.pool, "bytes", "k", 0.2, &ratelimit.LimitOpts{Config: &cfg})
	require.NoError(t, err)
	require.True(t, res.OK)
	r, tt := limitRT(t, m, res)
	require.Equal(t, int64(3), r)
	if tt != 0 {
		later, err := ratelimit.New(&ratelimit.LimiterConfig{Now: func() time.Time { return t0.Add(time.Duration(tt) * time.Second) }})
		require.NoError(t, err)
		st, err := later.State(context.Background(), b.pool, "bytes", "k", &ratelimit.LimitOpts{Config: &cfg})
		require.NoError(t, err)
		require.GreaterOrEqual(t, int64(math.Floor(st.Value)), r+1, "RateLimit r=%d;t=%d: %d s after the grant the limit holds %g: r is still %d",
			r, tt, tt, st.Value, int64(math.Floor(st.Value)))
	}
	// With a whole unit to come, t is there: a cost of 2 leaves 1.3, r=1, and 2 comes after 4.2 s.
	res, err = b.limiter.LimitN(context.Background(), b.pool, "bytes", "k", 2, &ratelimit.LimitOpts{Config: &cfg})
	require.NoError(t, err)
	require.True(t, res.OK)
	r, tt = limitRT(t, m, res)
	require.Equal(t, int64(1), r)
	require.Equal(t, int64(5), tt)
}
