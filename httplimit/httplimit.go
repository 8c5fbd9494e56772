package httplimit

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"

	"github.com/txlimit/txlimit/internal/countbound"
	"github.com/txlimit/txlimit/ratelimit"
)

// Decider decides a request's limits together, all or nothing, on a connection of its own: a
// *ratelimit.Batcher (the one to use: concurrent requests share one statement and one commit), or
// a *ratelimit.Limiter on a pool, one statement per request (see OnPool).
type Decider interface {
	LimitMany(ctx context.Context, reqs []ratelimit.Request, opts *ratelimit.LimitOpts) (ratelimit.ManyResult, error)
}

var _ Decider = (*ratelimit.Batcher)(nil)

// OnPool returns a Decider that decides with limiter on pool, one statement per request (a
// *ratelimit.Batcher is faster under load and needs no adapter): LimitN
// for a single policy (the leaner statement), LimitMany for several. Neither may be nil: New
// refuses such a Decider.
func OnPool(limiter *ratelimit.Limiter, pool *pgxpool.Pool) Decider {
	return poolDecider{limiter: limiter, pool: pool}
}

type poolDecider struct {
	limiter *ratelimit.Limiter
	pool    *pgxpool.Pool
}

func (d poolDecider) LimitMany(ctx context.Context, reqs []ratelimit.Request, opts *ratelimit.LimitOpts) (ratelimit.ManyResult, error) {
	if len(reqs) != 1 || opts != nil {
		return d.limiter.LimitMany(ctx, d.pool, reqs, opts)
	}
	r := reqs[0]
	count := r.Count
	if count == 0 {
		count = 1 // Request's default
	}
	res, err := d.limiter.LimitN(ctx, d.pool, r.Name, r.Key, count, &ratelimit.LimitOpts{Config: r.Config, Reserve: r.Reserve})
	if err != nil {
		return ratelimit.ManyResult{}, err
	}
	return ratelimit.ManyResult{OK: res.OK, RetryAt: res.RetryAt, Results: []ratelimit.Result{res}, Time: res.Time}, nil
}

// MissingKey is what a policy does with a request for which its KeyFunc finds no key.
type MissingKey int

const (
	// MissingKeyReject answers 400 Bad Request. It is the zero MissingKey, so the default.
	MissingKeyReject MissingKey = iota
	// MissingKeySkip leaves the policy out for that request: it is neither charged nor reported.
	MissingKeySkip
	// MissingKeyShared charges the policy's key "" (one bucket shared by every keyless request).
	MissingKeyShared
)

// Policy is one limit the middleware applies to every request.
type Policy struct {
	// Config is the limit, passed with every request (ratelimit.Request.Config), so it need not be
	// registered on the Limiter. It also gives the advertised quota (q, w). Required.
	Config ratelimit.Config

	// Key names the client, e.g. ClientIP(nil) or Header("X-API-Key"). Nil declares a limit that
	// the middleware does not decide, only describes, for handlers that decide it themselves and
	// call WriteHeaders. Defaults to nil.
	Key KeyFunc

	// MissingKey is the outcome for a request without a key (Key returns "" or ErrNoKey).
	// Defaults to MissingKeyReject.
	MissingKey MissingKey

	// Name is the limit's name in the database and the policy's name in the header fields and the
	// problem body. Unique within a Middleware. Required. It is written in the header fields as a
	// Structured Field String (RFC 9651), so it must be printable ASCII (0x20 to 0x7E); New refuses
	// any other.
	Name string

	// QuotaUnit is the unit of the policy's quota and of what remains of it, written as the qu
	// parameter of RateLimit-Policy: "content-bytes" when Config.Cost charges a request's size, say.
	// It must be one of the values the draft's RateLimit Quota Units registry lists, "requests",
	// "content-bytes" or "concurrent-requests" (clients ignore a malformed field); New refuses any
	// other. Defaults to "": no qu parameter, which the draft reads as "requests".
	QuotaUnit string
}

// Config configures a Middleware. Fields are alphabetical.
type Config struct {
	// Cost returns the tokens a request takes of every policy, e.g. from its size. 0 lets the
	// request through without a decision; an error or an invalid cost (negative, NaN) is a 400.
	// The header fields count tokens, which clients read as requests unless Policy.QuotaUnit says
	// otherwise. Defaults to nil: 1 per request.
	Cost func(r *http.Request) (float64, error)

	// Decider decides the policies. Required when a Policy has a Key. Defaults to nil.
	Decider Decider

	// DecisionTimeout bounds the wait for the Decider's decision: one not made within it (a
	// database that hangs, unreachable behind a network partition, or too slow) is a failed
	// decision, let through with FailOpen (or Shadow), else refused with 503 (FailClosedRetryAfter),
	// and counted and logged as any other. Through a Batcher, a request whose batch was already
	// deciding may have been charged nonetheless. The request's own context, when it ends first,
	// ends the wait as the package doc says ("Errors": outcome "canceled"). Defaults to 0: no
	// bound but the request's context, so that a database that hangs holds every request until its
	// context ends (for one without a deadline, until its client gives up), and FailOpen lets none
	// of them through. Negative makes New return an error.
	DecisionTimeout time.Duration

	// FailClosedRetryAfter is the Retry-After of the 503 answered when the Decider fails and the
	// request is refused (fail closed), rounded up to whole seconds, plus the jitter of
	// RetryJitter. Defaults to 0: DefaultFailClosedRetryAfter (5 s). Negative makes New return an
	// error.
	FailClosedRetryAfter time.Duration

	// FailOpen lets a request through when the Decider fails (database down, timeout), counting
	// it (outcome "fail_open") and logging it at warn level. Defaults to false: fail closed, a 503
	// with Retry-After (FailClosedRetryAfter), counted (outcome "error") and logged at error
	// level. A request whose own context ended before its decision (the client went away) is no
	// failure: it is not let through (unless Shadow lets every request through), nor logged (see
	// the package doc, "Errors").
	FailOpen bool

	// Logger receives fail-open and fail-closed errors (warn and error) and shadow denials
	// (info). Defaults to nil: slog.Default(), as it is when a record is logged.
	Logger *slog.Logger

	// MeterProvider provides the meter (named "github.com/txlimit/txlimit/httplimit", the package's
	// path) of the counter txlimit.http.requests, which counts requests by policy (txlimit.policy) and
	// outcome (txlimit.outcome), never by key: "granted" for each policy of a granted request,
	// "denied" for each violated policy of a denied request (the other policies of it consumed nothing
	// and are not counted), "shadow_denied" likewise under Config.Shadow (the request went on),
	// "fail_open" and "error" for each policy of a request whose decision failed (let through, or
	// refused with 503), "canceled" for each policy of a request whose own context ended before its
	// decision (the client went away, or the request's deadline passed), "invalid" for a 400 on bad
	// input, "no_key" for a 400 on a missing key, and "skipped" for a policy left out by
	// MissingKeySkip. Defaults to nil: the global provider
	// (otel.GetMeterProvider()), which records nothing until the application sets one with
	// otel.SetMeterProvider.
	MeterProvider metric.MeterProvider

	// OmitSuccessHeaders leaves the RateLimit-Policy and RateLimit fields off granted requests;
	// denials always carry them. Defaults to false: sent on every decided request.
	OmitSuccessHeaders bool

	// Policies are the limits, decided together for every request. At least one. Required.
	Policies []Policy

	// RetryJitter adds, to Retry-After, 0 to RetryJitter (in whole seconds) of deterministic
	// per-identity jitter (see the package doc). Defaults to 0: none. Negative makes New return an
	// error.
	RetryJitter time.Duration

	// Secret keys the HMAC of the partition keys (pk) and of the jitter. Set the same secret on
	// every replica so that a client sees one pk. Defaults to nil: 32 random bytes per
	// Middleware.
	Secret []byte

	// Shadow decides and counts every request but never refuses one: every request goes on to
	// the next handler, without RateLimit fields. A denial is counted as "shadow_denied"; a
	// database error as "fail_open", as with FailOpen; a missing key or invalid input under its
	// usual outcome. Defaults to false.
	Shadow bool
}

// DefaultFailClosedRetryAfter is the Retry-After of a fail-closed 503 when
// Config.FailClosedRetryAfter is 0: a database restart or failover usually takes a few seconds to
// tens of seconds, so clients come back soon without hammering one that is still down.
const DefaultFailClosedRetryAfter = 5 * time.Second

// Middleware rate-limits requests. It is safe for concurrent use.
type Middleware struct {
	cfg        Config
	byName     map[string]*Policy
	decided    []*Policy
	secret     []byte
	macs       sync.Pool             // of HMAC-SHA256 keyed with secret (partitionKey)
	items      map[string]*sync.Pool // policy name -> pool of its *sfItems (WriteHeaders)
	jitterS    int64
	failRetryS int64 // Retry-After of a fail-closed 503 before jitter, in seconds
	obs        *observer
	policies   []Policy
}

// New validates cfg and returns a Middleware. It returns an error naming the first invalid field;
// an invalid Policy.Config is a *ratelimit.ConfigError, and so is, when Config.Cost is nil, the
// Config of a decided policy (one with a Key) that can never grant a request its cost of 1 token:
// a Capacity below 1, or, with Shards N >= 2, below N/2 (a call draws on at most two shards, each
// holding Capacity/N; docs/spec.md §5 and §8). Capacity defaults to Rate, so a Rate below 1
// needs a Capacity of its own.
func New(cfg *Config) (*Middleware, error) {
	if cfg == nil || len(cfg.Policies) == 0 {
		return nil, errors.New("httplimit: Config.Policies is empty: give at least one Policy")
	}
	m := &Middleware{cfg: *cfg, byName: make(map[string]*Policy, len(cfg.Policies))}
	m.policies = append([]Policy(nil), cfg.Policies...)
	limits := make(map[string]ratelimit.Config, len(m.policies))
	for i := range m.policies {
		p := &m.policies[i]
		if p.Name == "" {
			return nil, fmt.Errorf("httplimit: Config.Policies[%d].Name is empty", i)
		}
		if _, dup := m.byName[p.Name]; dup {
			return nil, fmt.Errorf("httplimit: Config.Policies[%d].Name %q appears twice", i, p.Name)
		}
		if !writable(p.Name) {
			return nil, fmt.Errorf("httplimit: Config.Policies[%d].Name %q cannot be written in the RateLimit header fields: "+
				"a Structured Field String is printable ASCII (0x20 to 0x7E)", i, p.Name)
		}
		switch p.QuotaUnit {
		case "", "requests", "content-bytes", "concurrent-requests":
		default:
			return nil, fmt.Errorf("httplimit: Config.Policies[%d].QuotaUnit %q is not a quota unit of the draft's registry: "+
				"use \"requests\", \"content-bytes\" or \"concurrent-requests\", or leave it empty", i, p.QuotaUnit)
		}
		if p.MissingKey < MissingKeyReject || p.MissingKey > MissingKeyShared {
			return nil, fmt.Errorf("httplimit: Config.Policies[%d].MissingKey %d is unknown", i, p.MissingKey)
		}
		m.byName[p.Name] = p
		limits[p.Name] = p.Config
		if p.Key != nil {
			m.decided = append(m.decided, p)
		}
	}
	// Validates every name and config as the Limiter will.
	if _, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: limits}); err != nil {
		return nil, err
	}
	if cfg.Cost == nil {
		for _, p := range m.decided {
			if err := grantsOne(p.Name, p.Config); err != nil {
				return nil, err
			}
		}
	}
	if len(m.decided) > 0 && cfg.Decider == nil {
		return nil, errors.New("httplimit: Config.Decider is nil: pass a *ratelimit.Batcher (ratelimit.NewBatcher(pool, limiter, nil))")
	}
	if len(m.decided) > 0 {
		switch d := cfg.Decider.(type) {
		case *ratelimit.Batcher:
			if d == nil {
				return nil, errors.New("httplimit: Config.Decider is a nil *ratelimit.Batcher: pass the one ratelimit.NewBatcher(pool, limiter, nil) returns")
			}
		case poolDecider:
			if d.limiter == nil || d.pool == nil {
				return nil, errors.New("httplimit: Config.Decider is OnPool(limiter, pool) with a nil limiter or pool: pass the *ratelimit.Limiter and the *pgxpool.Pool to decide on")
			}
		}
	}
	if cfg.RetryJitter < 0 {
		return nil, fmt.Errorf("httplimit: Config.RetryJitter must be >= 0 (got %s)", cfg.RetryJitter)
	}
	if cfg.FailClosedRetryAfter < 0 {
		return nil, fmt.Errorf("httplimit: New: set Config.FailClosedRetryAfter to 0 (the default, %s) or more (got %s)", DefaultFailClosedRetryAfter, cfg.FailClosedRetryAfter)
	}
	if cfg.DecisionTimeout < 0 {
		return nil, fmt.Errorf("httplimit: New: set Config.DecisionTimeout to 0 (the default: no bound but the request's context) or more (got %s)", cfg.DecisionTimeout)
	}
	m.jitterS = int64(cfg.RetryJitter / time.Second)
	m.failRetryS = ceilSeconds(DefaultFailClosedRetryAfter)
	if cfg.FailClosedRetryAfter > 0 {
		m.failRetryS = ceilSeconds(cfg.FailClosedRetryAfter)
	}
	m.secret = append([]byte(nil), cfg.Secret...)
	if len(m.secret) == 0 {
		m.secret = make([]byte, 32)
		_, _ = rand.Read(m.secret)
	}
	m.initHeaders()
	m.obs = newObserver(cfg.MeterProvider, cfg.Logger)
	return m, nil
}

// Handler returns next behind the limits: m.Handler is a func(http.Handler) http.Handler for
// net/http, chi's Use, gorilla's Use and the like.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(w, r, next) })
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	ctx := r.Context()
	// refuse answers status for the limiter, or under Shadow lets the request go on.
	refuse := func(status int, detail string) {
		if m.cfg.Shadow {
			next.ServeHTTP(w, r)
			return
		}
		writeProblem(w, status, detail)
	}
	cost := 1.0
	if m.cfg.Cost != nil {
		c, err := m.cfg.Cost(r)
		if err != nil || math.IsNaN(c) || c < 0 {
			m.obs.count(ctx, m.decided, outcomeInvalid)
			refuse(http.StatusBadRequest, "the request's cost is invalid")
			return
		}
		if c == 0 {
			next.ServeHTTP(w, r)
			return
		}
		cost = c
	}
	reqs := make([]ratelimit.Request, 0, len(m.decided))
	used := make([]*Policy, 0, len(m.decided))
	for _, p := range m.decided {
		key, err := p.Key(r)
		if err == nil && key == "" {
			err = ErrNoKey
		}
		if err != nil {
			if !errors.Is(err, ErrNoKey) {
				m.obs.count(ctx, []*Policy{p}, outcomeInvalid)
				refuse(http.StatusBadRequest, fmt.Sprintf("policy %q: no key can be derived from the request", p.Name))
				return
			}
			switch p.MissingKey {
			case MissingKeySkip:
				m.obs.count(ctx, []*Policy{p}, outcomeSkipped)
				continue
			case MissingKeyShared:
				key = ""
			default:
				m.obs.count(ctx, []*Policy{p}, outcomeNoKey)
				refuse(http.StatusBadRequest, fmt.Sprintf("policy %q: the request has no key", p.Name))
				return
			}
		}
		reqs = append(reqs, ratelimit.Request{Name: p.Name, Key: key, Count: cost, Config: &p.Config})
		used = append(used, p)
	}
	if len(reqs) == 0 {
		next.ServeHTTP(w, r)
		return
	}
	res, err := m.decide(ctx, reqs)
	switch {
	case err != nil && errors.Is(err, ratelimit.ErrInvalid):
		m.obs.count(ctx, used, outcomeInvalid)
		refuse(http.StatusBadRequest, "the request's rate limit input is invalid")
		return
	case err != nil && ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)):
		// The request's own context ended before the decision (the client went away, or the
		// request's deadline passed): not a failed decision, so nothing is let through (Shadow
		// aside, which refuses nothing) and nothing is logged.
		m.obs.count(ctx, used, outcomeCanceled)
		if m.cfg.Shadow {
			next.ServeHTTP(w, r)
			return
		}
		w.WriteHeader(canceledStatus(ctx))
		return
	case err != nil && (m.cfg.FailOpen || m.cfg.Shadow):
		m.obs.count(ctx, used, outcomeFailOpen)
		msg := "httplimit: rate limit decision failed; request let through (FailOpen)"
		if !m.cfg.FailOpen {
			msg = "httplimit: rate limit decision failed; request let through (Shadow)"
		}
		m.obs.logger().WarnContext(ctx, msg, "method", r.Method, "path", r.URL.Path, "policies", names(used), "error", err)
		next.ServeHTTP(w, r)
		return
	case err != nil:
		m.obs.count(ctx, used, outcomeError)
		retry := m.failRetryS + m.jitterKeys(reqs)
		m.obs.logger().ErrorContext(ctx, "httplimit: rate limit decision failed; request refused with 503 and Retry-After",
			"method", r.Method, "path", r.URL.Path, "policies", names(used), "retry_after", retry, "error", err)
		w.Header().Set("Retry-After", strconv.FormatInt(retry, 10))
		writeProblem(w, http.StatusServiceUnavailable, "the rate limit could not be decided")
		return
	case !res.OK && m.cfg.Shadow:
		m.obs.countDenied(ctx, res.Results, outcomeShadowDenied)
		m.obs.logger().InfoContext(ctx, "httplimit: request would have been denied (Shadow)", "method", r.Method, "path", r.URL.Path, "violated", violated(res.Results))
		next.ServeHTTP(w, r)
		return
	case !res.OK:
		m.obs.countDenied(ctx, res.Results, outcomeDenied)
		m.WriteDenied(w, res.Results...)
		return
	}
	m.obs.count(ctx, used, outcomeGranted)
	if !m.cfg.OmitSuccessHeaders && !m.cfg.Shadow {
		m.WriteHeaders(w, res.Results...)
	}
	next.ServeHTTP(w, r)
}

// decide decides reqs with the Decider, within Config.DecisionTimeout when it is set: a decision
// not made in time is an error that wraps context.DeadlineExceeded, while ctx has not ended.
func (m *Middleware) decide(ctx context.Context, reqs []ratelimit.Request) (ratelimit.ManyResult, error) {
	if m.cfg.DecisionTimeout <= 0 {
		return m.cfg.Decider.LimitMany(ctx, reqs, nil)
	}
	dctx, cancel := context.WithTimeout(ctx, m.cfg.DecisionTimeout)
	defer cancel()
	res, err := m.cfg.Decider.LimitMany(dctx, reqs, nil)
	if err != nil && ctx.Err() == nil && dctx.Err() != nil {
		err = fmt.Errorf("httplimit: no decision within Config.DecisionTimeout (%s): %w", m.cfg.DecisionTimeout, err)
	}
	return res, err
}

// grantsOne returns a *ratelimit.ConfigError when a request for 1 token, the cost without
// Config.Cost, exceeds what the limit cfg named name could ever grant (without Reserve): what one
// shard holds, or two together when sharded.
func grantsOne(name string, cfg ratelimit.Config) error {
	n := max(cfg.Shards, 1)
	if _, ok := countbound.Check(capacity(cfg)/float64(n), 0, n >= 2, 1); ok {
		return nil
	}
	reason := "must be at least 1, the cost of a request when Config.Cost is nil (Capacity defaults to Rate)"
	if n >= 2 {
		reason = fmt.Sprintf("must be at least Shards/2 (%g), since a request costs 1 when Config.Cost is nil and "+
			"a call draws on at most two shards, each holding Capacity/Shards (Capacity defaults to Rate)", float64(n)/2)
	}
	return &ratelimit.ConfigError{Limit: name, Field: "Capacity", Value: capacity(cfg), Reason: reason}
}

// statusClientClosedRequest is nginx's status for a request whose client went away before the
// answer: no client reads it, but access logs and HTTP metrics do, and it is no server error.
const statusClientClosedRequest = 499

// canceledStatus is the status of a request whose context ended before its decision: 499 when
// it was cancelled without a cause (net/http's way when the client goes away), 503 Service
// Unavailable otherwise: its deadline passed, or the server cancelled it with a cause (shutting
// down, say), and the client may still be waiting for an answer.
func canceledStatus(ctx context.Context) int {
	if errors.Is(ctx.Err(), context.Canceled) && context.Cause(ctx) == context.Canceled {
		return statusClientClosedRequest
	}
	return http.StatusServiceUnavailable
}

// names returns the names of policies.
func names(policies []*Policy) []string {
	out := make([]string, len(policies))
	for i, p := range policies {
		out[i] = p.Name
	}
	return out
}

// violated returns the names of the denied results.
func violated(results []ratelimit.Result) []string {
	names := []string{}
	for _, r := range results {
		if !r.OK {
			names = append(names, r.Name)
		}
	}
	return names
}
