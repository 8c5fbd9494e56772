package httplimit_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/txlimit/txlimit/httplimit"
	"github.com/txlimit/txlimit/internal/metrictest"
	"github.com/txlimit/txlimit/ratelimit"
)

// failing is a Decider whose every decision fails with err, as one on a database that is down.
type failing struct{ err error }

func (f failing) LimitMany(context.Context, []ratelimit.Request, *ratelimit.LimitOpts) (ratelimit.ManyResult, error) {
	return ratelimit.ManyResult{}, f.err
}

// hanging is a Decider on a database that answers nothing (a network partition, a primary that
// hangs): its decision fails only when its context ends.
type hanging struct{}

func (hanging) LimitMany(ctx context.Context, _ []ratelimit.Request, _ *ratelimit.LimitOpts) (ratelimit.ManyResult, error) {
	<-ctx.Done()
	return ratelimit.ManyResult{}, ctx.Err()
}

var errDown = errors.New("ratelimit: LimitMany: failed to connect to `user=postgres database=test`: connection refused")

// records is an slog.Handler that keeps each record as "LEVEL message key=value ...".
type records struct {
	mu    sync.Mutex
	lines []string
}

func (h *records) Enabled(context.Context, slog.Level) bool { return true }
func (h *records) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *records) WithGroup(string) slog.Handler            { return h }

func (h *records) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Level.String() + " " + r.Message)
	r.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&b, " %s=%s", a.Key, a.Value)
		return true
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lines = append(h.lines, b.String())
	return nil
}

func (h *records) all() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.lines...)
}

// failureRun is what one request against a failing Decider produced.
type failureRun struct {
	res  response
	logs []string
	// requests reads txlimit.http.requests for policy and outcome.
	requests func(policy, outcome string) int64
}

// serveFailing sends one GET /items with header (name, value, ...) through a middleware whose
// Decider fails (cfg.Decider, or failing{errDown} when nil), with cfg's other options and a
// Logger and MeterProvider of its own.
func serveFailing(t *testing.T, cfg httplimit.Config, header ...string) failureRun {
	t.Helper()
	logs := &records{}
	reader := sdkmetric.NewManualReader()
	if cfg.Decider == nil {
		cfg.Decider = failing{errDown}
	}
	cfg.Secret = secret
	cfg.Logger = slog.New(logs)
	cfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	m, err := httplimit.New(&cfg)
	require.NoError(t, err)
	srv := httptest.NewServer(m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte("ok"))
	})))
	t.Cleanup(srv.Close)
	res := get(t, srv.URL+"/items", header...)
	return failureRun{res: res, logs: logs.all(), requests: func(policy, outcome string) int64 {
		return metrictest.Counter(t, reader, "txlimit.http.requests", attribute.String("txlimit.policy", policy), attribute.String("txlimit.outcome", outcome))
	}}
}

const body503 = `{"type":"about:blank","title":"Service Unavailable","status":503,"detail":"the rate limit could not be decided"}` + "\n"

// Issue 31, item 7: a failed decision refused (fail closed) says when to come back, and is
// logged and counted; let through (FailOpen, Shadow) it is logged and counted too.
func TestDecisionFailure(t *testing.T) {
	t.Parallel()
	perIPPolicy := httplimit.Policy{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)}
	perUserPolicy := httplimit.Policy{Name: "perUser", Config: perIP, Key: httplimit.Header("X-User")}
	// The jitter of the identity (127.0.0.1, alice) for RetryJitter 10 s: as the package doc says.
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte("retry-after\x00127.0.0.1\x00alice"))
	jitter := int64(binary.BigEndian.Uint64(mac.Sum(nil)[:8]) % 11)

	t.Run("fail closed: 503, Retry-After 5", func(t *testing.T) {
		t.Parallel()
		run := serveFailing(t, httplimit.Config{Policies: []httplimit.Policy{perIPPolicy}})
		require.Equal(t, 503, run.res.status)
		require.Equal(t, "5", run.res.header.Get("Retry-After"))
		require.Equal(t, "application/problem+json", run.res.header.Get("Content-Type"))
		require.Equal(t, body503, run.res.body)
		require.Empty(t, run.res.header.Values("RateLimit"))
		require.Equal(t, []string{"ERROR httplimit: rate limit decision failed; request refused with 503 and Retry-After " +
			"method=GET path=/items policies=[perIP] retry_after=5 error=" + errDown.Error()}, run.logs)
		require.Equal(t, int64(1), run.requests("perIP", "error"))
	})
	t.Run("fail closed: FailClosedRetryAfter rounded up", func(t *testing.T) {
		t.Parallel()
		run := serveFailing(t, httplimit.Config{Policies: []httplimit.Policy{perIPPolicy}, FailClosedRetryAfter: 2500 * time.Millisecond})
		require.Equal(t, 503, run.res.status)
		require.Equal(t, "3", run.res.header.Get("Retry-After"))
		require.Equal(t, []string{"ERROR httplimit: rate limit decision failed; request refused with 503 and Retry-After " +
			"method=GET path=/items policies=[perIP] retry_after=3 error=" + errDown.Error()}, run.logs)
	})
	t.Run("fail closed: plus the identity's jitter", func(t *testing.T) {
		t.Parallel()
		run := serveFailing(t, httplimit.Config{Policies: []httplimit.Policy{perIPPolicy, perUserPolicy}, RetryJitter: 10 * time.Second},
			"X-User", "alice")
		require.Equal(t, 503, run.res.status)
		require.Equal(t, fmt.Sprint(5+jitter), run.res.header.Get("Retry-After"))
		require.Equal(t, []string{fmt.Sprintf("ERROR httplimit: rate limit decision failed; request refused with 503 and Retry-After "+
			"method=GET path=/items policies=[perIP perUser] retry_after=%d error=%s", 5+jitter, errDown)}, run.logs)
		require.Equal(t, int64(1), run.requests("perIP", "error"))
		require.Equal(t, int64(1), run.requests("perUser", "error"))
	})
	for _, tc := range []struct {
		mode string // as the log line names it
		cfg  httplimit.Config
	}{
		{"FailOpen", httplimit.Config{Policies: []httplimit.Policy{perIPPolicy}, FailOpen: true}},
		{"Shadow", httplimit.Config{Policies: []httplimit.Policy{perIPPolicy}, Shadow: true}},
	} {
		t.Run(tc.mode+": let through, logged and counted", func(t *testing.T) {
			t.Parallel()
			run := serveFailing(t, tc.cfg)
			require.Equal(t, 200, run.res.status)
			require.Equal(t, "ok", run.res.body)
			require.Empty(t, run.res.header.Values("Retry-After"))
			require.Equal(t, []string{"WARN httplimit: rate limit decision failed; request let through (" + tc.mode + ") " +
				"method=GET path=/items policies=[perIP] error=" + errDown.Error()}, run.logs)
			require.Equal(t, int64(1), run.requests("perIP", "fail_open"))
			require.Equal(t, int64(0), run.requests("perIP", "error"))
		})
	}
}

// With no Logger and no MeterProvider a failed decision still goes to slog.Default() (as it is
// when the request fails, not when New ran) and to the global MeterProvider. Not parallel: it
// sets both process-wide defaults, and restores them.
func TestDecisionFailureDefaults(t *testing.T) {
	prevLogger, prevWriter, prevFlags, prevMeters := slog.Default(), log.Writer(), log.Flags(), otel.GetMeterProvider()
	t.Cleanup(func() {
		slog.SetDefault(prevLogger)
		log.SetOutput(prevWriter)
		log.SetFlags(prevFlags)
		otel.SetMeterProvider(prevMeters)
	})
	reader := sdkmetric.NewManualReader()
	otel.SetMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))

	policy := httplimit.Policy{Name: "defaults", Config: perIP, Key: httplimit.ClientIP(nil)}
	closed, err := httplimit.New(&httplimit.Config{Decider: failing{errDown}, Policies: []httplimit.Policy{policy}})
	require.NoError(t, err)
	open, err := httplimit.New(&httplimit.Config{Decider: failing{errDown}, Policies: []httplimit.Policy{policy}, FailOpen: true})
	require.NoError(t, err)
	logs := &records{}
	slog.SetDefault(slog.New(logs)) // after New

	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("ok")) })
	for i, c := range []struct {
		m      *httplimit.Middleware
		status int
		retry  string
	}{{closed, 503, "5"}, {open, 200, ""}} {
		w := httptest.NewRecorder()
		c.m.Handler(ok).ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/items", nil))
		require.Equal(t, c.status, w.Code, "step %d", i)
		require.Equal(t, c.retry, w.Header().Get("Retry-After"), "step %d", i)
	}
	require.Equal(t, []string{
		"ERROR httplimit: rate limit decision failed; request refused with 503 and Retry-After method=GET path=/items policies=[defaults] retry_after=5 error=" + errDown.Error(),
		"WARN httplimit: rate limit decision failed; request let through (FailOpen) method=GET path=/items policies=[defaults] error=" + errDown.Error(),
	}, logs.all())
	for _, outcome := range []string{"error", "fail_open"} {
		require.Equal(t, int64(1), metrictest.Counter(t, reader, "txlimit.http.requests",
			attribute.String("txlimit.policy", "defaults"), attribute.String("txlimit.outcome", outcome)), outcome)
	}
}

// A database that hangs fails no call: each waited until its request's context ended (for a
// request without a deadline: until its client gave up), then was answered as a request that
// ended (no body, outcome "canceled", nothing logged), FailOpen or not, so FailOpen let nothing
// through on the commonest outage. Config.DecisionTimeout bounds the wait; a decision not made
// within it failed, as a database error does.
func TestDecisionTimeoutIsAFailedDecision(t *testing.T) {
	t.Parallel()
	policies := []httplimit.Policy{{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)}}
	const timeout = "httplimit: no decision within Config.DecisionTimeout (1ms): context deadline exceeded"

	run := serveFailing(t, httplimit.Config{Decider: hanging{}, DecisionTimeout: time.Millisecond, FailOpen: true, Policies: policies})
	require.Equal(t, http.StatusOK, run.res.status, "FailOpen let the request through")
	require.Equal(t, int64(1), run.requests("perIP", "fail_open"))
	require.Equal(t, int64(0), run.requests("perIP", "canceled"))
	require.Equal(t, []string{"WARN httplimit: rate limit decision failed; request let through (FailOpen) " +
		"method=GET path=/items policies=[perIP] error=" + timeout}, run.logs)

	run = serveFailing(t, httplimit.Config{Decider: hanging{}, DecisionTimeout: time.Millisecond, Policies: policies})
	require.Equal(t, http.StatusServiceUnavailable, run.res.status)
	require.Equal(t, "5", run.res.header.Get("Retry-After"))
	require.Equal(t, body503, run.res.body)
	require.Equal(t, int64(1), run.requests("perIP", "error"))
	require.Equal(t, []string{"ERROR httplimit: rate limit decision failed; request refused with 503 and Retry-After " +
		"method=GET path=/items policies=[perIP] retry_after=5 error=" + timeout}, run.logs)
}

// endedRun is what one request whose context had already ended produced.
type endedRun struct {
	handlerRan bool
	status     int
	logs       []string
	// requests reads txlimit.http.requests for policy and outcome.
	requests func(policy, outcome string) int64
}

// serveEnded sends one GET /items whose context ctx has already ended (the client closed the
// connection, or reset the HTTP/2 stream; or the request's deadline passed) through a middleware
// deciding with a real ratelimit.Batcher on the test database, with cfg's other options.
func serveEnded(t *testing.T, ctx context.Context, cfg httplimit.Config) endedRun {
	t.Helper()
	b := setup(t, fixed)
	batcher, err := ratelimit.NewBatcher(b.pool, b.limiter, nil)
	require.NoError(t, err)
	t.Cleanup(batcher.Close)
	rec := &records{}
	reader := sdkmetric.NewManualReader()
	cfg.Decider = batcher
	cfg.Secret = secret
	cfg.Logger = slog.New(rec)
	cfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	m, err := httplimit.New(&cfg)
	require.NoError(t, err)
	var run endedRun
	h := m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run.handlerRan = true
		_, _ = w.Write([]byte("ok"))
	}))
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/items", nil).WithContext(ctx))
	run.status, run.logs = w.Code, rec.all()
	run.requests = func(policy, outcome string) int64 {
		return metrictest.Counter(t, reader, "txlimit.http.requests", attribute.String("txlimit.policy", policy), attribute.String("txlimit.outcome", outcome))
	}
	return run
}

// cancelled returns a context the client has already cancelled: it has gone.
func cancelled() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

// Config.FailOpen lets a request through "when the Decider fails (database down, timeout)". A
// request whose own context was cancelled by the client is not a database failure: the Batcher
// never charged it (a call cancelled while queued is never charged). Were FailOpen to run the
// handler for it, uncharged, a client could get the handler run without paying the limit by
// cancelling its requests (an HTTP/2 RST_STREAM costs nothing), exactly when the queue is long.
func TestCancelledRequestIsNotLetThroughByFailOpen(t *testing.T) {
	t.Parallel()
	run := serveEnded(t, cancelled(), httplimit.Config{FailOpen: true,
		Policies: []httplimit.Policy{{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)}}})
	require.False(t, run.handlerRan, "the handler ran, uncharged, for a request the client had cancelled; logs: %q", run.logs)
	require.Equal(t, int64(0), run.requests("perIP", "fail_open"), "a client's cancellation counted as a failed decision let through")
	require.Equal(t, int64(1), run.requests("perIP", "canceled"))
	require.Equal(t, 499, run.status)
	require.Empty(t, run.logs)
}

// Fail closed, a client's cancellation is not counted as outcome "error" nor logged at error level
// as "rate limit decision failed": what the docs reserve for a database error (docs/spec.md §11).
// Otherwise any client could raise the error count and fill the error log (and page whoever
// alerts on them) by closing its connections, though the database is fine.
func TestCancelledRequestIsNotADatabaseError(t *testing.T) {
	t.Parallel()
	run := serveEnded(t, cancelled(), httplimit.Config{
		Policies: []httplimit.Policy{{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)}}})
	require.Equal(t, int64(0), run.requests("perIP", "error"), "a client's cancellation counted as a failed decision; logs: %q", run.logs)
	for _, l := range run.logs {
		require.NotContains(t, l, "ERROR", "a client's cancellation logged as a database failure")
	}
	require.Equal(t, int64(1), run.requests("perIP", "canceled"))
	require.Equal(t, 499, run.status, "no 5xx for a client that went away")
	require.False(t, run.handlerRan)
}

// A request whose deadline passed before its decision is answered 503 (its client may still be
// waiting), counted as "canceled"; under Shadow, which refuses nothing, it goes on.
func TestEndedRequestDeadlineAndShadow(t *testing.T) {
	t.Parallel()
	policies := []httplimit.Policy{{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)}}
	past := func() context.Context {
		ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
		t.Cleanup(cancel)
		return ctx
	}
	run := serveEnded(t, past(), httplimit.Config{FailOpen: true, Policies: policies})
	require.False(t, run.handlerRan)
	require.Equal(t, http.StatusServiceUnavailable, run.status)
	require.Equal(t, int64(1), run.requests("perIP", "canceled"))
	require.Empty(t, run.logs)

	run = serveEnded(t, cancelled(), httplimit.Config{Shadow: true, Policies: policies})
	require.True(t, run.handlerRan, "Shadow refuses nothing")
	require.Equal(t, int64(1), run.requests("perIP", "canceled"))
	require.Equal(t, int64(0), run.requests("perIP", "fail_open"))
	require.Empty(t, run.logs)
}
